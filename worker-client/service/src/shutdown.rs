//! Waiting for the operator's stop signal.

use std::future::Future;

/// Listens for Ctrl-C (SIGINT) and, on Unix, SIGTERM, and returns a future that completes on the
/// first of them. The handlers are installed when this function is called, not when the future
/// is first polled, so a signal that arrives in between is not lost (it would otherwise kill the
/// process with the default action). Must be called inside a Tokio runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let listen = |kind: SignalKind, name: &'static str| {
            signal(kind)
                .map_err(|err| tracing::error!(error = %err, "cannot listen for {name}"))
                .ok()
        };
        let interrupt = listen(SignalKind::interrupt(), "SIGINT");
        let terminate = listen(SignalKind::terminate(), "SIGTERM");
        async move {
            tokio::select! {
                () = received(interrupt) => tracing::info!("SIGINT received, shutting down"),
                () = received(terminate) => tracing::info!("SIGTERM received, shutting down"),
            }
        }
    }
    #[cfg(not(unix))]
    async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %err, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
        tracing::info!("Ctrl-C received, shutting down");
    }
}

/// Resolves on the next delivery of `signal`; never, when it could not be listened for.
#[cfg(unix)]
async fn received(signal: Option<tokio::signal::unix::Signal>) {
    match signal {
        Some(mut signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}
