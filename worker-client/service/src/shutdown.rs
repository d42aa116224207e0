//! Waiting for the operator's stop signal.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::{Stream, StreamExt};

/// Listens for Ctrl-C (SIGINT) and, on Unix, SIGTERM, and returns a future that completes on the
/// first of them. The handlers are installed when this function is called, not when the future
/// is first polled, so a signal that arrives in between is not lost (it would otherwise kill the
/// process with the default action). Must be called inside a Tokio runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    let mut signals = StopSignals::listen();
    async move {
        match signals.next().await {
            Some(name) => tracing::info!("{name} received, shutting down"),
            None => std::future::pending().await,
        }
    }
}

/// The stop signals, from the moment [`StopSignals::listen`] installs their handlers on: a
/// stream of their names (`"SIGINT"`, `"SIGTERM"`), each delivery once. It ends only when no
/// signal could be listened for.
pub(crate) struct StopSignals {
    #[cfg(unix)]
    interrupt: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    terminate: Option<tokio::signal::unix::Signal>,
    #[cfg(not(unix))]
    ctrl_c: Option<Pin<Box<dyn Future<Output = std::io::Result<()>> + Send>>>,
}

impl StopSignals {
    /// Installs the handlers (inside a Tokio runtime); one that cannot be is logged and left out.
    pub(crate) fn listen() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let listen = |kind: SignalKind, name: &'static str| {
                signal(kind)
                    .map_err(|err| tracing::error!(error = %err, "cannot listen for {name}"))
                    .ok()
            };
            StopSignals {
                interrupt: listen(SignalKind::interrupt(), "SIGINT"),
                terminate: listen(SignalKind::terminate(), "SIGTERM"),
            }
        }
        #[cfg(not(unix))]
        StopSignals {
            ctrl_c: Some(Box::pin(tokio::signal::ctrl_c())),
        }
    }
}

impl Stream for StopSignals {
    type Item = &'static str;

    #[cfg(unix)]
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<&'static str>> {
        let this = &mut *self;
        let mut listening = false;
        for (signal, name) in [
            (&mut this.interrupt, "SIGINT"),
            (&mut this.terminate, "SIGTERM"),
        ] {
            let Some(receiver) = signal else { continue };
            match receiver.poll_recv(cx) {
                Poll::Ready(Some(())) => return Poll::Ready(Some(name)),
                // The driver is gone: this one will never come.
                Poll::Ready(None) => *signal = None,
                Poll::Pending => listening = true,
            }
        }
        if listening {
            Poll::Pending
        } else {
            Poll::Ready(None)
        }
    }

    #[cfg(not(unix))]
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<&'static str>> {
        let Some(ctrl_c) = self.ctrl_c.as_mut() else {
            return Poll::Ready(None);
        };
        match ctrl_c.as_mut().poll(cx) {
            Poll::Ready(Ok(())) => {
                self.ctrl_c = Some(Box::pin(tokio::signal::ctrl_c()));
                Poll::Ready(Some("Ctrl-C"))
            }
            Poll::Ready(Err(err)) => {
                tracing::error!(error = %err, "cannot listen for Ctrl-C");
                self.ctrl_c = None;
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
