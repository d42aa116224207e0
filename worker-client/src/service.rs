//! Small pieces every pd-bootstrap binary shares: log set-up, the shutdown signal, duration
//! flags and error formatting.

use std::io::IsTerminal;
use std::time::Duration;

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Installs the global tracing subscriber writing to stderr. The level comes from `RUST_LOG`
/// (default `info`). Calling it twice is harmless (the second call does nothing).
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %err, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(err) => {
                tracing::error!(error = %err, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("SIGINT received, shutting down"),
        () = terminate => tracing::info!("SIGTERM received, shutting down"),
    }
}

/// Parses a positive number of seconds, fractions allowed (`"960"`, `"0.5"`), for duration flags.
pub fn parse_seconds(text: &str) -> Result<Duration, String> {
    match parse_seconds_or_zero(text)? {
        d if d.is_zero() => Err(format!("{text:?} must be a positive number of seconds")),
        d => Ok(d),
    }
}

/// Parses a non-negative number of seconds, fractions allowed; `"0"` is allowed.
pub fn parse_seconds_or_zero(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if !(seconds.is_finite() && (0.0..1e9).contains(&seconds)) {
        return Err(format!(
            "{text:?} must be a number of seconds from 0 to 1e9"
        ));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// An error and its sources on one line (a transport's top-level message alone hides the cause).
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_parsed() {
        assert_eq!(parse_seconds("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_seconds_or_zero("0"), Ok(Duration::ZERO));
        for bad in ["0", "-1", "soon", "inf", "NaN", "1e12"] {
            assert!(parse_seconds(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[derive(Debug, thiserror::Error)]
    #[error("error sending request")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn error_chains_name_every_cause() {
        let outer = Outer(std::io::Error::other("connection refused"));
        assert_eq!(
            error_chain(&outer),
            "error sending request: connection refused"
        );
    }
}
