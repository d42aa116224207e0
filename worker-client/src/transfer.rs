//! The KV data path over TCP: a P worker exports KV blocks under a transfer id, a D worker pulls
//! them.
//!
//! A worker's transfer address names its transport: `tcp://host:port` is this one (HTTP/1.1 on a
//! plain TCP listener: `GET /kv/{transfer_id}?wait_ms=N`). Because the proxy sends a request to P
//! and to D at the same time, D usually asks before P has finished prefill: the exporter holds the
//! pull open until the KV is published or the wait runs out, so D never polls. Published KV is
//! held until one pull takes it or the hold timeout passes, so an abandoned transfer cannot leak.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use serde::Deserialize;
use tokio::sync::Notify;

use crate::serve::{serve, ServeLimits};

/// The scheme of addresses served by this transport.
pub const TCP_SCHEME: &str = "tcp";

/// The longest a pull may ask the exporter to wait.
const MAX_WAIT: Duration = Duration::from_secs(600);

/// Why a transfer failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransferError {
    /// The address is not `tcp://host:port` (e.g. another transport's `ucx://`).
    #[error("transfer address {addr:?} is not supported by the TCP transport (expected tcp://host:port)")]
    UnsupportedAddress {
        /// The address given.
        addr: String,
    },
    /// The exporter could not be reached or broke the connection.
    #[error("cannot pull {transfer_id} from {addr}: {reason}")]
    Unreachable {
        /// The exporter's address.
        addr: String,
        /// The transfer id.
        transfer_id: String,
        /// What failed.
        reason: String,
    },
    /// The KV did not appear before the deadline.
    #[error("KV for {transfer_id} was not published at {addr} within {waited:?}")]
    NotPublished {
        /// The exporter's address.
        addr: String,
        /// The transfer id.
        transfer_id: String,
        /// How long D waited.
        waited: Duration,
    },
    /// The exporter could not be started.
    #[error("cannot listen on {addr}: {reason}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// What failed.
        reason: String,
    },
}

enum Slot {
    /// Published and not yet pulled; dropped at `expires`.
    Ready { kv: Bytes, expires: Instant },
    /// Someone pulls before it was published; they wait on `notify`.
    Awaited { notify: Arc<Notify>, since: Instant },
}

struct Shelf {
    slots: Mutex<HashMap<String, Slot>>,
    hold: Duration,
}

impl Shelf {
    fn slots(&self) -> MutexGuard<'_, HashMap<String, Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn take(&self, transfer_id: &str) -> Option<Bytes> {
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
    fn take_or_wait(&self, transfer_id: &str) -> Result<Bytes, Arc<Notify>> {
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

    /// Drops published KV nobody pulled and waits nobody fulfilled within the hold time.
    fn sweep(&self) -> usize {
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

/// P side: holds KV blocks under transfer ids and serves them to D on a TCP listener.
#[derive(Clone)]
pub struct KvExporter {
    shelf: Arc<Shelf>,
    addr: SocketAddr,
}

#[derive(Deserialize)]
struct PullParams {
    #[serde(default)]
    wait_ms: u64,
}

async fn serve_pull(
    State(shelf): State<Arc<Shelf>>,
    Path(transfer_id): Path<String>,
    Query(params): Query<PullParams>,
) -> Response {
    let wait = Duration::from_millis(params.wait_ms).min(MAX_WAIT);
    let notify = match shelf.take_or_wait(&transfer_id) {
        Ok(kv) => return kv.into_response(),
        Err(notify) => notify,
    };
    let notified = notify.notified();
    tokio::pin!(notified);
    notified.as_mut().enable();
    // Published between registering as a waiter and enabling the notification?
    if let Some(kv) = shelf.take(&transfer_id) {
        return kv.into_response();
    }
    let _ = tokio::time::timeout(wait, notified).await;
    match shelf.take(&transfer_id) {
        Some(kv) => kv.into_response(),
        None => (StatusCode::NOT_FOUND, "not published").into_response(),
    }
}

impl KvExporter {
    /// Listens on `addr` (port 0 picks one) and serves pulls in the background until the
    /// runtime stops. Published KV nobody pulls is dropped after `hold`.
    pub async fn bind(addr: SocketAddr, hold: Duration) -> Result<Self, TransferError> {
        let bind_error = |e: std::io::Error| TransferError::Bind {
            addr,
            reason: e.to_string(),
        };
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(bind_error)?;
        let addr = listener.local_addr().map_err(bind_error)?;
        let shelf = Arc::new(Shelf {
            slots: Mutex::new(HashMap::new()),
            hold,
        });
        let app = Router::new()
            .route("/kv/{transfer_id}", get(serve_pull))
            .with_state(shelf.clone());
        tokio::spawn(async move {
            let forever = std::future::pending();
            if let Err(err) = serve(listener, app, forever, ServeLimits::default()).await {
                tracing::error!(error = %err, "KV exporter stopped");
            }
        });
        let janitor = Arc::downgrade(&shelf);
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(
                hold.clamp(Duration::from_millis(50), Duration::from_secs(1)),
            );
            loop {
                ticker.tick().await;
                let Some(shelf) = janitor.upgrade() else {
                    break;
                };
                let dropped = shelf.sweep();
                if dropped > 0 {
                    tracing::debug!(dropped, "expired KV transfers dropped");
                }
            }
        });
        Ok(KvExporter { shelf, addr })
    }

    /// The address to register: `tcp://host:port`.
    pub fn transfer_addr(&self) -> String {
        format!("{TCP_SCHEME}://{}", self.addr)
    }

    /// Makes `kv` available under `transfer_id` and wakes a D worker already waiting for it.
    pub fn publish(&self, transfer_id: &str, kv: Bytes) {
        let slot = Slot::Ready {
            kv,
            expires: Instant::now() + self.shelf.hold,
        };
        let previous = self.shelf.slots().insert(transfer_id.to_owned(), slot);
        if let Some(Slot::Awaited { notify, .. }) = previous {
            notify.notify_waiters();
        }
    }

    /// How many transfers are held or awaited.
    pub fn pending(&self) -> usize {
        self.shelf.slots().len()
    }
}

/// D side: pulls KV from exporters. Cheap to clone; share one per process.
#[derive(Clone)]
pub struct KvPuller {
    http: reqwest::Client,
}

impl Default for KvPuller {
    fn default() -> Self {
        Self::new(Duration::from_secs(3))
    }
}

impl KvPuller {
    /// A puller whose connections must open within `connect_timeout`.
    pub fn new(connect_timeout: Duration) -> Self {
        let http = reqwest::Client::builder()
            .connect_timeout(connect_timeout)
            .build()
            .expect("a plain HTTP client builds");
        KvPuller { http }
    }

    /// Pulls the KV published under `transfer_id` at `addr` (`tcp://host:port`), waiting for P
    /// to publish it for at most `deadline`, which bounds the whole call.
    pub async fn pull(
        &self,
        addr: &str,
        transfer_id: &str,
        deadline: Duration,
    ) -> Result<Bytes, TransferError> {
        let host_port = addr
            .strip_prefix("tcp://")
            .filter(|rest| !rest.is_empty() && !rest.contains('/'))
            .ok_or_else(|| TransferError::UnsupportedAddress {
                addr: addr.to_owned(),
            })?;
        let unreachable = |reason: String| TransferError::Unreachable {
            addr: addr.to_owned(),
            transfer_id: transfer_id.to_owned(),
            reason,
        };
        let started = Instant::now();
        let id: String = url::form_urlencoded::byte_serialize(transfer_id.as_bytes()).collect();
        let url = format!(
            "http://{host_port}/kv/{id}?wait_ms={}",
            deadline.as_millis()
        );
        // The exporter answers at the latest when the wait ends; allow a little for the bytes.
        let call = async {
            let response = self
                .http
                .get(&url)
                .send()
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            match response.status() {
                StatusCode::OK => response
                    .bytes()
                    .await
                    .map_err(|e| unreachable(e.to_string())),
                StatusCode::NOT_FOUND => Err(TransferError::NotPublished {
                    addr: addr.to_owned(),
                    transfer_id: transfer_id.to_owned(),
                    waited: started.elapsed(),
                }),
                other => Err(unreachable(format!("exporter answered {other}"))),
            }
        };
        match tokio::time::timeout(deadline + Duration::from_secs(1), call).await {
            Ok(result) => result,
            Err(_) => Err(TransferError::NotPublished {
                addr: addr.to_owned(),
                transfer_id: transfer_id.to_owned(),
                waited: started.elapsed(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn exporter(hold: Duration) -> KvExporter {
        KvExporter::bind("127.0.0.1:0".parse().unwrap(), hold)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_pull_waits_for_publication() {
        let exporter = exporter(Duration::from_secs(5)).await;
        let addr = exporter.transfer_addr();
        let puller = KvPuller::default();
        let pulling =
            tokio::spawn(async move { puller.pull(&addr, "xfer-1", Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        exporter.publish("xfer-1", Bytes::from_static(b"kv bytes"));
        assert_eq!(
            pulling.await.unwrap().unwrap(),
            Bytes::from_static(b"kv bytes")
        );
        assert_eq!(exporter.pending(), 0, "a pull takes the KV");
    }

    #[tokio::test]
    async fn a_waiter_never_replaces_published_kv() {
        let exporter = exporter(Duration::from_secs(5)).await;
        exporter.publish("x", Bytes::from_static(b"kv"));
        // A pull that finds the KV takes it; it never swaps it for a wait slot.
        assert_eq!(
            exporter.shelf.take_or_wait("x").unwrap(),
            Bytes::from_static(b"kv")
        );
        assert!(exporter.shelf.take_or_wait("y").is_err());
        assert!(
            exporter.shelf.take_or_wait("y").is_err(),
            "a second waiter shares the slot"
        );
        assert_eq!(exporter.pending(), 1);
    }

    #[tokio::test]
    async fn published_kv_is_pulled_once() {
        let exporter = exporter(Duration::from_secs(5)).await;
        exporter.publish("x", Bytes::from(vec![7u8; 1 << 20]));
        let puller = KvPuller::default();
        let addr = exporter.transfer_addr();
        assert_eq!(
            puller
                .pull(&addr, "x", Duration::from_secs(1))
                .await
                .unwrap()
                .len(),
            1 << 20
        );
        let again = puller.pull(&addr, "x", Duration::from_millis(100)).await;
        assert!(
            matches!(again, Err(TransferError::NotPublished { .. })),
            "{again:?}"
        );
    }

    #[tokio::test]
    async fn failures_are_bounded_and_clear() {
        let puller = KvPuller::default();
        let started = Instant::now();
        let exporter = exporter(Duration::from_millis(100)).await;
        let missing = puller
            .pull(
                &exporter.transfer_addr(),
                "never",
                Duration::from_millis(300),
            )
            .await;
        assert!(
            matches!(missing, Err(TransferError::NotPublished { .. })),
            "{missing:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(2));

        let wrong = puller
            .pull("ucx://127.0.0.1:1", "x", Duration::from_secs(1))
            .await;
        assert!(
            matches!(wrong, Err(TransferError::UnsupportedAddress { .. })),
            "{wrong:?}"
        );

        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let down = puller
            .pull(
                &format!("tcp://127.0.0.1:{port}"),
                "x",
                Duration::from_secs(1),
            )
            .await;
        assert!(
            matches!(down, Err(TransferError::Unreachable { .. })),
            "{down:?}"
        );

        // KV nobody pulls is dropped after the hold time.
        exporter.publish("abandoned", Bytes::from_static(b"x"));
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(exporter.pending(), 0);
    }
}
