//! What both transports' exporters share: KV held under transfer ids with held-open pulls, the
//! janitor that expires it, and the HTTP listener the pulls arrive on.
//!
//! Because the proxy sends a request to P and to D at the same time, D usually asks before P has
//! finished prefill: a pull waits (up to its `wait_ms`) until the KV is published, so D never
//! polls. Published KV is held until one pull takes it or the hold time passes, so an abandoned
//! transfer cannot leak.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use axum::Router;
use tokio::sync::Notify;

use super::TransferError;
use pd_service::{serve, ServeLimits};

/// The longest a pull may ask the exporter to wait.
pub(crate) const MAX_WAIT: Duration = Duration::from_secs(600);

enum Slot<T> {
    /// Published and not yet pulled; dropped at `expires`.
    Ready { kv: T, expires: Instant },
    /// Someone pulls before it was published; they wait on `notify`.
    Awaited { notify: Arc<Notify>, since: Instant },
}

/// KV of type `T` held under transfer ids until one pull takes it.
pub(crate) struct Shelf<T> {
    slots: Mutex<HashMap<String, Slot<T>>>,
    hold: Duration,
}

impl<T> Shelf<T> {
    /// An empty shelf that drops what nobody takes within `hold`.
    pub(crate) fn new(hold: Duration) -> Self {
        Shelf {
            slots: Mutex::new(HashMap::new()),
            hold,
        }
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<String, Slot<T>>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn take(&self, transfer_id: &str) -> Option<T> {
        let mut slots = self.slots();
        match slots.get(transfer_id) {
            Some(Slot::Ready { .. }) => match slots.remove(transfer_id) {
                Some(Slot::Ready { kv, .. }) => Some(kv),
                _ => None,
            },
            _ => None,
        }
    }

    /// Takes the published KV, or (in the same critical section, so a publish cannot slip in
    /// between) registers as a waiter and returns what to wait on.
    pub(crate) fn take_or_wait(&self, transfer_id: &str) -> Result<T, Arc<Notify>> {
        let mut slots = self.slots();
        match slots.remove(transfer_id) {
            Some(Slot::Ready { kv, .. }) => Ok(kv),
            Some(Slot::Awaited { notify, since }) => {
                slots.insert(
                    transfer_id.to_owned(),
                    Slot::Awaited {
                        notify: notify.clone(),
                        since,
                    },
                );
                Err(notify)
            }
            None => {
                let notify = Arc::new(Notify::new());
                let slot = Slot::Awaited {
                    notify: notify.clone(),
                    since: Instant::now(),
                };
                slots.insert(transfer_id.to_owned(), slot);
                Err(notify)
            }
        }
    }

    /// Takes the KV published under `transfer_id`, waiting up to `wait` for it to be published.
    pub(crate) async fn take_within(&self, transfer_id: &str, wait: Duration) -> Option<T> {
        let notify = match self.take_or_wait(transfer_id) {
            Ok(kv) => return Some(kv),
            Err(notify) => notify,
        };
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // Published between registering as a waiter and enabling the notification?
        if let Some(kv) = self.take(transfer_id) {
            return Some(kv);
        }
        let _ = tokio::time::timeout(wait.min(MAX_WAIT), notified).await;
        self.take(transfer_id)
    }

    /// Makes `kv` available under `transfer_id` and wakes a pull already waiting for it.
    pub(crate) fn publish(&self, transfer_id: &str, kv: T) {
        let slot = Slot::Ready {
            kv,
            expires: Instant::now() + self.hold,
        };
        let previous = self.slots().insert(transfer_id.to_owned(), slot);
        if let Some(Slot::Awaited { notify, .. }) = previous {
            notify.notify_waiters();
        }
    }

    /// How many transfers are held or awaited.
    pub(crate) fn pending(&self) -> usize {
        self.slots().len()
    }

    /// Drops published KV nobody pulled and waits nobody fulfilled within the hold time.
    pub(crate) fn sweep(&self) -> usize {
        let now = Instant::now();
        let hold = self.hold;
        let mut slots = self.slots();
        let before = slots.len();
        slots.retain(|_, slot| match slot {
            Slot::Ready { expires, .. } => *expires > now,
            // Kept while someone still waits on it (a pull may wait longer than the hold).
            Slot::Awaited { notify, since } => {
                Arc::strong_count(notify) > 1 || now.duration_since(*since) < hold
            }
        });
        before - slots.len()
    }
}

/// Calls `sweep` on `state` a few times per hold period until the state is dropped.
pub(crate) fn spawn_janitor<S: Send + Sync + 'static>(
    state: Weak<S>,
    hold: Duration,
    sweep: fn(&S) -> usize,
) {
    tokio::spawn(async move {
        let mut ticker =
            tokio::time::interval(hold.clamp(Duration::from_millis(50), Duration::from_secs(1)));
        loop {
            ticker.tick().await;
            let Some(state) = state.upgrade() else {
                break;
            };
            let dropped = sweep(&state);
            if dropped > 0 {
                tracing::debug!(dropped, "expired KV transfers dropped");
            }
        }
    });
}

/// Listens on `addr` (port 0 picks one) and serves `app` in the background until the runtime
/// stops; returns the bound address.
pub(crate) async fn listen(addr: SocketAddr, app: Router) -> Result<SocketAddr, TransferError> {
    let bind_error = |e: std::io::Error| TransferError::Bind {
        addr,
        reason: e.to_string(),
    };
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(bind_error)?;
    let bound = listener.local_addr().map_err(bind_error)?;
    tokio::spawn(async move {
        let forever = std::future::pending();
        let limits = ServeLimits {
            upgrades: true,
            ..ServeLimits::default()
        };
        if let Err(err) = serve(listener, app, forever, limits).await {
            tracing::error!(error = %err, "KV exporter stopped");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_waiter_never_replaces_published_kv() {
        let shelf = Shelf::new(Duration::from_secs(5));
        shelf.publish("x", 1);
        // A pull that finds the KV takes it; it never swaps it for a wait slot.
        assert_eq!(shelf.take_or_wait("x").unwrap(), 1);
        assert!(shelf.take_or_wait("y").is_err());
        assert!(
            shelf.take_or_wait("y").is_err(),
            "a second waiter shares the slot"
        );
        assert_eq!(shelf.pending(), 1);
    }

    #[tokio::test]
    async fn a_held_pull_gets_what_is_published_while_it_waits() {
        let shelf = Arc::new(Shelf::new(Duration::from_secs(5)));
        let waiting = {
            let shelf = shelf.clone();
            tokio::spawn(async move { shelf.take_within("t", Duration::from_secs(5)).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        shelf.publish("t", 7);
        assert_eq!(waiting.await.unwrap(), Some(7));
        assert_eq!(
            shelf.take_within("t", Duration::from_millis(20)).await,
            None
        );
    }

    #[tokio::test]
    async fn unpulled_kv_expires() {
        let shelf = Shelf::new(Duration::from_millis(20));
        shelf.publish("t", 1);
        assert_eq!(shelf.sweep(), 0);
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(shelf.sweep(), 1);
        assert_eq!(shelf.pending(), 0);
    }
}
