//! What the writer measures for operators: how many worker writes each batch carried, and how
//! long making a batch durable took. On sled that is the flush that every registration of the
//! batch waits for, so a slow or failing disk shows here first (what etcd's own
//! `wal_fsync_duration` tells about etcd); with etcd a commit is durable when it returns and the
//! flush costs nothing. A batch with nothing to make durable (every write refused) is not
//! counted; one whose writes changed nothing (replays) is, with a flush of about 0. With traces
//! on, each batch is a span too ([`BatchTrace`]).

use std::time::Duration;

use prometheus::core::Collector;
use prometheus::{Histogram, HistogramOpts};

/// The writer's histograms, shared with the server's `/metrics` (see
/// [`Registry::write_stats`](super::Registry::write_stats)).
pub struct WriteStats {
    batch_size: Histogram,
    flush_seconds: Histogram,
}

impl WriteStats {
    pub(super) fn new() -> Self {
        let batch_size = Histogram::with_opts(
            HistogramOpts::new(
                "bootstrap_write_batch_size",
                "Worker writes (registrations, deregistrations...) the writer took together and made durable with one flush",
            )
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]),
        )
        .expect("valid metric");
        let flush_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "bootstrap_store_flush_duration_seconds",
                "Time to make one batch of worker changes durable (sled's flush to disk; about 0 with etcd, whose commits are durable when they return)",
            )
            .buckets(vec![
                0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                1.0, 5.0,
            ]),
        )
        .expect("valid metric");
        WriteStats {
            batch_size,
            flush_seconds,
        }
    }

    /// Records one batch of `writes` and how long its flush took.
    pub(super) fn observe_batch(&self, writes: usize, flush: Duration) {
        self.batch_size.observe(writes as f64);
        self.flush_seconds.observe(flush.as_secs_f64());
    }

    /// The histograms, for a Prometheus registry.
    pub fn collectors(&self) -> [Box<dyn Collector>; 2] {
        [
            Box::new(self.batch_size.clone()),
            Box::new(self.flush_seconds.clone()),
        ]
    }
}

/// One batch of the writer, as a span of its own (with traces on): the writes it carried, how
/// many failed, the revision it made durable, and the time its commits and its flush took.
pub(super) struct BatchTrace {
    /// When the batch began.
    pub started: std::time::SystemTime,
    /// The store's commits.
    pub commit: Duration,
    /// The flush that made them durable.
    pub flush: Duration,
    /// Writes in the batch.
    pub writes: usize,
    /// Of which refused or failed.
    pub failed: usize,
    /// The revision made durable (0: none).
    pub revision: u64,
    /// Why the flush failed, if it did.
    pub flush_error: Option<String>,
}

impl BatchTrace {
    /// Records the span.
    pub fn record(self) {
        use opentelemetry::trace::{Span, Status, Tracer};
        use opentelemetry::KeyValue;
        let tracer = pd_service::traces::tracer();
        let mut span = tracer
            .span_builder("registry write")
            .with_start_time(self.started)
            .with_attributes([
                KeyValue::new("pd.writes", self.writes as i64),
                KeyValue::new("pd.writes.failed", self.failed as i64),
                KeyValue::new("pd.revision", self.revision as i64),
                KeyValue::new("pd.store.commit_ms", self.commit.as_secs_f64() * 1e3),
                KeyValue::new("pd.store.flush_ms", self.flush.as_secs_f64() * 1e3),
            ])
            .start(&tracer);
        if let Some(error) = self.flush_error {
            span.set_status(Status::error(error));
        }
        span.end();
    }
}
