//! How the binaries log: human-readable lines or JSON, to stderr, filtered by `RUST_LOG`.
//!
//! Lines are written to stderr by a thread of their own, not by the task that logs: a log
//! reader that stalls (a collector that stops reading, a pipe nobody drains) must not stall the
//! requests, and a write to stderr is a system call the request would otherwise wait for. Up to
//! [`QUEUED_LINES`] lines wait for that thread; past that, new lines are dropped, not queued.
//! The thread writes the lines waiting for it together, in one system call per
//! [`WRITE_BUFFER`] bytes, and flushes as soon as none is waiting: a burst of lines (64 workers
//! registering at once) costs a few writes instead of one each, and no line is held back once the
//! burst is over.

use std::io::IsTerminal;

use tracing_appender::non_blocking::{NonBlockingBuilder, WorkerGuard};

/// How many log lines may wait to be written before new ones are dropped (a few MiB).
pub const QUEUED_LINES: usize = 16_384;

/// How many bytes of log lines the writer thread gathers into one write at most.
pub const WRITE_BUFFER: usize = 64 * 1024;

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// The thread that writes the log lines. Keep it for the life of the process: dropping it
/// writes out the lines still waiting (a process that exits without dropping it may lose them).
#[must_use = "dropping it stops the log writer: keep it until the process exits"]
pub struct Logging {
    _writer: Option<WorkerGuard>,
}

/// Installs the global tracing subscriber writing to stderr. The level comes from `RUST_LOG`
/// (default `info`). Calling it twice is harmless (the second call installs nothing).
pub fn init_logging(format: LogFormat) -> Logging {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = std::io::stderr().is_terminal();
    let (writer, guard) = NonBlockingBuilder::default()
        .buffered_lines_limit(QUEUED_LINES)
        .lossy(true)
        .thread_name("pd-log-writer")
        .finish(std::io::BufWriter::with_capacity(
            WRITE_BUFFER,
            std::io::stderr(),
        ));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    let installed = match format {
        LogFormat::Text => builder.with_ansi(ansi).try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    Logging {
        _writer: installed.is_ok().then_some(guard),
    }
}
