//! The KV data path over TCP: the KV bytes themselves travel in the answer to
//! `GET /kv/{transfer_id}?wait_ms=N` on the exporter's listener (`tcp://host:port`).
//!
//! A puller that asks for it (`Upgrade: pd-kv`) gets KV of [`RAW_MIN_BYTES`] or more as raw
//! bytes on the connection after a `101 Switching Protocols` carrying their length in
//! `x-kv-length`: D then reads them straight into its buffer, as a plain socket would, instead
//! of through an HTTP body's frames and a copy out of each (a third of the pull's time for
//! 64 MiB). Smaller KV, and pullers that do not ask, get an ordinary `200` body.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, Request, State};
use axum::http::header::{CONNECTION, UPGRADE};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;

use crate::pull::{held_get, pull_url, PullClient, PullParams, KV_LENGTH, RAW_PROTOCOL};
use crate::shelf::{listen, spawn_janitor, Shelf};
use crate::{TransferError, TCP_SCHEME};

/// KV at least this large is sent raw to a puller that asks for it.
pub const RAW_MIN_BYTES: usize = 64 << 10;

/// How long the exporter may take to write one KV to a puller on a raw connection (a stalled
/// puller is dropped after it).
const RAW_SEND_TIMEOUT: Duration = Duration::from_secs(60);

async fn serve_pull(
    State(shelf): State<Arc<Shelf<Bytes>>>,
    Path(transfer_id): Path<String>,
    Query(params): Query<PullParams>,
    request: Request,
) -> Response {
    let wait = Duration::from_millis(params.wait_ms);
    let Some(kv) = shelf.take_within(&transfer_id, wait).await else {
        return (StatusCode::NOT_FOUND, "not published").into_response();
    };
    let wants_raw = request
        .headers()
        .get(UPGRADE)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(RAW_PROTOCOL.as_bytes()));
    if !wants_raw || kv.len() < RAW_MIN_BYTES {
        return kv.into_response();
    }
    let switched = hyper::upgrade::on(request);
    let length = kv.len();
    tokio::spawn(async move {
        let send = async {
            let mut io = TokioIo::new(switched.await.map_err(std::io::Error::other)?);
            io.write_all(&kv).await?;
            io.shutdown().await
        };
        match tokio::time::timeout(RAW_SEND_TIMEOUT, send).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => tracing::warn!(%transfer_id, error = %err, "raw KV send failed"),
            Err(_) => tracing::warn!(%transfer_id, "raw KV send timed out"),
        }
    });
    (
        StatusCode::SWITCHING_PROTOCOLS,
        [
            (UPGRADE, RAW_PROTOCOL.to_owned()),
            (CONNECTION, "upgrade".to_owned()),
            (KV_LENGTH, length.to_string()),
        ],
    )
        .into_response()
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
            http: PullClient::new(connect_timeout).offering_raw(),
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

    /// Sends `request` on a fresh connection to `exporter` and returns the answer's head and
    /// everything after it until the exporter closes or `body_len` bytes have come.
    async fn exchange(exporter: &KvExporter, request: &str, body_len: usize) -> (String, Vec<u8>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = exporter.transfer_addr().replace("tcp://", "");
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let mut chunk = vec![0u8; 1 << 16];
        loop {
            let head_end = answer.windows(4).position(|w| w == b"\r\n\r\n");
            if head_end.is_some_and(|end| answer.len() >= end + 4 + body_len) {
                break;
            }
            let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut chunk));
            match read.await.unwrap().unwrap() {
                0 => break,
                n => answer.extend_from_slice(&chunk[..n]),
            }
        }
        let end = answer.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
        let head = String::from_utf8(answer[..end].to_vec())
            .unwrap()
            .to_lowercase();
        (head, answer[end + 4..].to_vec())
    }

    /// Large KV goes raw after a 101 to a puller that asks for it, as an ordinary body to one
    /// that does not; small KV always as a body.
    #[tokio::test]
    async fn large_kv_is_sent_raw_only_when_asked() {
        let exporter = exporter(Duration::from_secs(5)).await;
        let large: Vec<u8> = (0..RAW_MIN_BYTES * 4).map(|i| (i % 251) as u8).collect();
        let get = |id: &str, upgrade: bool| {
            let upgrade = if upgrade {
                "Connection: upgrade\r\nUpgrade: pd-kv\r\n"
            } else {
                ""
            };
            format!("GET /kv/{id}?wait_ms=1000 HTTP/1.1\r\nHost: p\r\n{upgrade}\r\n")
        };

        exporter.publish("raw", &large).unwrap();
        let (head, bytes) = exchange(&exporter, &get("raw", true), large.len()).await;
        assert!(head.starts_with("http/1.1 101"), "{head}");
        assert!(
            head.contains(&format!("x-kv-length: {}", large.len())),
            "{head}"
        );
        assert!(head.contains("upgrade: pd-kv"), "{head}");
        assert_eq!(bytes, large);

        exporter.publish("plain", &large).unwrap();
        let (head, bytes) = exchange(&exporter, &get("plain", false), large.len()).await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", large.len())),
            "{head}"
        );
        assert_eq!(bytes, large);

        exporter.publish("small", b"tiny kv").unwrap();
        let (head, bytes) = exchange(&exporter, &get("small", true), 7).await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert_eq!(bytes, b"tiny kv");
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
