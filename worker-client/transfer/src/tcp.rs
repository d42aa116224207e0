//! The KV data path over TCP: the KV bytes themselves travel in the HTTP answer to
//! `GET /kv/{transfer_id}?wait_ms=N` on the exporter's listener (`tcp://host:port`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use bytes::Bytes;

use crate::pull::{held_get, pull_url, PullClient, PullParams};
use crate::shelf::{listen, spawn_janitor, Shelf};
use crate::{TransferError, TCP_SCHEME};

async fn serve_pull(
    State(shelf): State<Arc<Shelf<Bytes>>>,
    Path(transfer_id): Path<String>,
    Query(params): Query<PullParams>,
) -> Response {
    let wait = Duration::from_millis(params.wait_ms);
    match shelf.take_within(&transfer_id, wait).await {
        Some(kv) => kv.into_response(),
        None => (StatusCode::NOT_FOUND, "not published").into_response(),
    }
}

/// P side: holds KV bytes under transfer ids and serves them on a TCP listener.
#[derive(Clone)]
pub struct TcpExporter {
    shelf: Arc<Shelf<Bytes>>,
    addr: SocketAddr,
}

impl TcpExporter {
    /// Listens on `addr` (port 0 picks one) and serves pulls in the background until the
    /// runtime stops. Published KV nobody pulls is dropped after `hold`.
    pub async fn bind(addr: SocketAddr, hold: Duration) -> Result<Self, TransferError> {
        let shelf = Arc::new(Shelf::new(hold));
        let app = Router::new()
            .route("/kv/{transfer_id}", get(serve_pull))
            .with_state(shelf.clone());
        let addr = listen(addr, app).await?;
        spawn_janitor(Arc::downgrade(&shelf), hold, Shelf::sweep);
        Ok(TcpExporter { shelf, addr })
    }

    /// The address to register: `tcp://host:port`.
    pub fn transfer_addr(&self) -> String {
        format!("{TCP_SCHEME}://{}", self.addr)
    }

    /// Makes `kv` available under `transfer_id` and wakes a D worker already waiting for it.
    pub fn publish(&self, transfer_id: &str, kv: Bytes) {
        self.shelf.publish(transfer_id, kv);
    }

    /// How many transfers are held or awaited.
    pub fn pending(&self) -> usize {
        self.shelf.pending()
    }
}

/// D side of the TCP transport.
#[derive(Clone)]
pub struct TcpPuller {
    http: PullClient,
}

impl TcpPuller {
    /// A puller whose connections must open within `connect_timeout`.
    pub fn new(connect_timeout: Duration) -> Self {
        TcpPuller {
            http: PullClient::new(connect_timeout),
        }
    }

    /// Pulls the KV published under `transfer_id` at `addr` (`tcp://host_port`) into `buffer`
    /// (its allocation reused when large enough) and returns it, waiting for P to publish it for
    /// at most `deadline`, which bounds the whole call.
    pub async fn pull(
        &self,
        addr: &str,
        host_port: &str,
        transfer_id: &str,
        deadline: Duration,
        buffer: Vec<u8>,
    ) -> Result<Vec<u8>, TransferError> {
        let url = pull_url(host_port, transfer_id, deadline);
        held_get(&self.http, &url, (addr, transfer_id), deadline, buffer).await
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::{KvExporter, KvPuller};

    async fn exporter(hold: Duration) -> KvExporter {
        KvExporter::bind("127.0.0.1:0".parse().unwrap(), hold)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_pull_waits_for_publication() {
        let exporter = exporter(Duration::from_secs(5)).await;
        let addr = exporter.transfer_addr();
        assert!(addr.starts_with("tcp://127.0.0.1:"), "{addr}");
        let puller = KvPuller::default();
        let pulling =
            tokio::spawn(async move { puller.pull(&addr, "xfer-1", Duration::from_secs(5)).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        exporter.publish("xfer-1", b"kv bytes").unwrap();
        assert_eq!(
            pulling.await.unwrap().unwrap(),
            Bytes::from_static(b"kv bytes")
        );
        assert_eq!(exporter.pending(), 0, "a pull takes the KV");
    }

    #[tokio::test]
    async fn a_pull_into_a_buffer_reuses_its_memory() {
        let exporter = exporter(Duration::from_secs(5)).await;
        let addr = exporter.transfer_addr();
        let puller = KvPuller::default();
        let mut buffer = vec![0u8; 4 << 20];
        for (i, len) in [(0u8, 3 << 20), (1, 1 << 20)] {
            let kv = vec![i + 1; len];
            exporter.publish(&format!("x{i}"), &kv).unwrap();
            let at = buffer.as_ptr();
            buffer = puller
                .pull_into(&addr, &format!("x{i}"), Duration::from_secs(5), buffer)
                .await
                .unwrap();
            assert_eq!(buffer, kv);
            assert_eq!(buffer.as_ptr(), at, "the buffer was not reused");
        }
    }

    #[tokio::test]
    async fn published_kv_is_pulled_once() {
        let exporter = exporter(Duration::from_secs(5)).await;
        exporter.publish("x", &vec![7u8; 1 << 20]).unwrap();
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
            .pull("rdma://127.0.0.1:1", "x", Duration::from_secs(1))
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
        exporter.publish("abandoned", b"x").unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(exporter.pending(), 0);
    }
}
