//! Stopping without losing requests, in two steps: first the server says it is not ready (so
//! that load balancers, Kubernetes endpoints among them, stop sending it new work) while it
//! still serves everything as usual; then it stops accepting connections and lets the requests
//! in flight finish. [`Draining`] is the state its readiness handlers, its long polls and
//! [`serve`](crate::serve) share; [`drain_on_signal`] is the shutdown future that drives it from
//! SIGINT/SIGTERM.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use tokio::sync::watch;

use crate::shutdown::StopSignals;

/// What a readiness route says while its server drains.
const SHUTTING_DOWN: &str = "shutting down";

/// A server's way out, shared by everything that answers differently on it: readiness routes
/// fail from [`begin`](Draining::begin) on, every answer then closes its connection (see
/// [`ServeLimits::draining`](crate::ServeLimits::draining)), and long polls end once
/// [`serve`](crate::serve) stops accepting ([`stopping`](Draining::stopping)). Clones share
/// one state.
#[derive(Debug, Clone, Default)]
pub struct Draining(Arc<State>);

#[derive(Debug, Default)]
struct State {
    /// Read on every answer, so an atomic rather than the channel's lock.
    draining: AtomicBool,
    /// Turns true when the server stops accepting.
    stopping: watch::Sender<bool>,
}

impl Draining {
    /// A server that is not draining.
    pub fn new() -> Self {
        Self::default()
    }

    /// From now on the server is on its way out: its readiness routes fail. Idempotent.
    pub fn begin(&self) {
        self.0.draining.store(true, Ordering::Relaxed);
    }

    /// Whether [`begin`](Draining::begin) was called (or the server stopped accepting).
    pub fn is_draining(&self) -> bool {
        self.0.draining.load(Ordering::Relaxed)
    }

    /// Why a readiness route fails: `"shutting down"` while draining, none before.
    pub fn not_ready_reason(&self) -> Option<&'static str> {
        self.is_draining().then_some(SHUTTING_DOWN)
    }

    /// The server stops accepting connections ([`serve`](crate::serve) says so when its
    /// shutdown future resolves).
    pub(crate) fn stop(&self) {
        self.begin();
        self.0.stopping.send_replace(true);
    }

    /// Resolves once the server stops accepting (at once if it has): a long poll answers then
    /// rather than holding the shutdown for its whole wait.
    pub async fn stopping(&self) {
        let mut stopping = self.0.stopping.subscribe();
        // The sender lives in `self`: waiting cannot fail.
        let _ = stopping.wait_for(|stopping| *stopping).await;
    }
}

/// A server's shutdown future for SIGINT and SIGTERM, listened for from this call on: the first
/// signal begins `draining` (readiness fails, everything else is served as usual) for `delay`,
/// or until a second signal; then the future resolves and the server stops accepting and
/// finishes the requests in flight. With a zero `delay` it resolves at the first signal.
pub fn drain_on_signal(
    draining: &Draining,
    delay: Duration,
) -> impl Future<Output = ()> + Send + 'static {
    let signals = StopSignals::listen();
    let draining = draining.clone();
    async move { drain_then_stop(&draining, delay, signals).await }
}

/// [`drain_on_signal`] on any source of signal names.
async fn drain_then_stop(
    draining: &Draining,
    delay: Duration,
    mut signals: impl Stream<Item = &'static str> + Unpin,
) {
    let Some(first) = signals.next().await else {
        // No signal can come: serve until the process is killed.
        return std::future::pending().await;
    };
    draining.begin();
    if delay.is_zero() {
        tracing::info!("{first} received, shutting down");
        return;
    }
    tracing::info!(
        ?delay,
        "{first} received: not ready while still serving for the shutdown delay, then \
         stopping (another signal stops at once)"
    );
    tokio::select! {
        () = tokio::time::sleep(delay) => tracing::info!("shutdown delay over, stopping"),
        Some(second) = signals.next() => {
            tracing::info!("{second} received again: stopping without the rest of the delay");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::sync::mpsc;

    fn signals() -> (
        mpsc::UnboundedSender<&'static str>,
        impl Stream<Item = &'static str> + Unpin,
    ) {
        let (send, mut receive) = mpsc::unbounded_channel();
        (
            send,
            futures_util::stream::poll_fn(move |cx| receive.poll_recv(cx)),
        )
    }

    #[tokio::test]
    async fn the_first_signal_drains_for_the_delay_then_stops() {
        let draining = Draining::new();
        let (send, signals) = signals();
        let stop = tokio::spawn({
            let draining = draining.clone();
            async move { drain_then_stop(&draining, Duration::from_millis(300), signals).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(draining.not_ready_reason(), None);
        let sent = Instant::now();
        send.send("SIGTERM").unwrap();
        while !draining.is_draining() {
            tokio::task::yield_now().await;
        }
        assert_eq!(draining.not_ready_reason(), Some("shutting down"));
        stop.await.unwrap();
        let took = sent.elapsed();
        assert!(took >= Duration::from_millis(280), "{took:?}");
    }

    #[tokio::test]
    async fn a_second_signal_skips_the_rest_of_the_delay() {
        let draining = Draining::new();
        let (send, signals) = signals();
        let stop = tokio::spawn({
            let draining = draining.clone();
            async move { drain_then_stop(&draining, Duration::from_secs(60), signals).await }
        });
        send.send("SIGTERM").unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(draining.is_draining() && !stop.is_finished());
        send.send("SIGINT").unwrap();
        tokio::time::timeout(Duration::from_secs(5), stop)
            .await
            .expect("the second signal ends the delay")
            .unwrap();
    }

    #[tokio::test]
    async fn stopping_resolves_for_waiters_old_and_new() {
        let draining = Draining::new();
        let waiter = tokio::spawn({
            let draining = draining.clone();
            async move { draining.stopping().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished());
        draining.stop();
        assert!(draining.is_draining());
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), draining.stopping())
            .await
            .expect("a later waiter returns at once");
    }
}
