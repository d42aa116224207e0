//! The pull protocol both transports share: D asks the exporter's HTTP listener for
//! `GET /kv/{transfer_id}?wait_ms=N`, which the exporter holds open until P publishes the KV or
//! the wait ends (404). Over TCP the answer is the KV itself; over UCX it is the descriptor D then
//! reads one-sidedly.

use std::time::{Duration, Instant};

use axum::http::header::{CONNECTION, CONTENT_LENGTH, UPGRADE};
use axum::http::{HeaderName, Method, Request, Response, StatusCode};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use pd_service::error_chain;
use serde::Deserialize;
use tokio::io::AsyncReadExt;

use crate::TransferError;

/// The query of a pull: how long the exporter may hold it open for the KV to be published.
#[derive(Deserialize)]
pub(crate) struct PullParams {
    #[serde(default)]
    pub(crate) wait_ms: u64,
}

/// The URL of a pull of `transfer_id` from the exporter at `host_port`, held open for `wait`.
pub(crate) fn pull_url(host_port: &str, transfer_id: &str, wait: Duration) -> String {
    let id: String = url::form_urlencoded::byte_serialize(transfer_id.as_bytes()).collect();
    format!("http://{host_port}/kv/{id}?wait_ms={}", wait.as_millis())
}

/// The protocol a pull offers to switch to (`Upgrade: pd-kv`): after a `101`, the KV's bytes
/// alone, [`KV_LENGTH`] of them.
pub(crate) const RAW_PROTOCOL: &str = "pd-kv";

/// The header of a `101` answer to a pull that gives the KV's length in bytes.
pub(crate) const KV_LENGTH: HeaderName = HeaderName::from_static("x-kv-length");

/// The largest answer a pull takes (KV of one request on one worker): 4 GiB.
pub(crate) const MAX_PULL_BYTES: u64 = 4 << 30;

/// Bytes the client reads from the socket at a time: KV answers are megabytes, and hyper's
/// default (growing from 8 KiB) spends more on per-read work than on the bytes.
const READ_BUFFER_BYTES: usize = 1 << 20;

/// The HTTP client of pulls: plain HTTP/1.1 over TCP, reading in large slices.
#[derive(Clone)]
pub(crate) struct PullClient {
    http: Client<HttpConnector, Empty<Bytes>>,
    /// Whether its GETs offer to take the KV raw (the TCP transport; see [`crate::tcp`]).
    offers_raw: bool,
}

impl PullClient {
    /// A client whose connections must open within `connect_timeout`.
    pub(crate) fn new(connect_timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_nodelay(true);
        let http = Client::builder(TokioExecutor::new())
            .http1_read_buf_exact_size(READ_BUFFER_BYTES)
            .build(connector);
        PullClient {
            http,
            offers_raw: false,
        }
    }

    /// The same client, its GETs offering `Upgrade: pd-kv` (the TCP transport's pulls).
    pub(crate) fn offering_raw(self) -> Self {
        PullClient {
            offers_raw: true,
            ..self
        }
    }

    async fn send(&self, method: Method, url: &str) -> Result<Response<Incoming>, String> {
        let mut request = Request::builder().method(method.clone()).uri(url);
        if self.offers_raw && method == Method::GET {
            request = request
                .header(CONNECTION, "upgrade")
                .header(UPGRADE, RAW_PROTOCOL);
        }
        let request = request.body(Empty::new()).map_err(|e| e.to_string())?;
        self.http
            .request(request)
            .await
            .map_err(|e| error_chain(&e))
    }

    /// `DELETE url`: the answer's status.
    #[cfg(feature = "ucx")]
    pub(crate) async fn delete(&self, url: &str) -> Result<StatusCode, String> {
        Ok(self.send(Method::DELETE, url).await?.status())
    }
}

/// The whole body of `response`, at most `max` bytes, read into `out` (emptied first; its
/// allocation is reused when large enough, else sized once from the `Content-Length`): a KV
/// arrives in many frames, and growing a fresh buffer as they come would copy it over and over
/// and fault in new pages on every pull.
async fn read_body(
    response: Response<Incoming>,
    max: u64,
    mut out: Vec<u8>,
) -> Result<Vec<u8>, String> {
    let too_large =
        |len: u64| format!("the answer holds {len} bytes, more than the {max} a pull takes");
    let expected = response
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .unwrap_or(0);
    if expected > max {
        return Err(too_large(expected));
    }
    let mut body = response.into_body();
    out.clear();
    out.reserve(expected as usize);
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(|e| e.to_string())?.into_data() else {
            continue; // trailers
        };
        let len = (out.len() + data.len()) as u64;
        if len > max {
            return Err(too_large(len));
        }
        out.extend_from_slice(&data);
    }
    Ok(out)
}

/// The KV sent raw after a `101` (see [`crate::tcp`]): exactly `x-kv-length` bytes, at most
/// `max`, read from the connection straight into `out` (emptied first, its allocation reused
/// when large enough, never zero-filled).
async fn read_raw(
    response: Response<Incoming>,
    max: u64,
    mut out: Vec<u8>,
) -> Result<Vec<u8>, String> {
    let length = response
        .headers()
        .get(KV_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .ok_or("a 101 answer without a valid x-kv-length")?;
    if length > max {
        return Err(format!(
            "the answer holds {length} bytes, more than the {max} a pull takes"
        ));
    }
    let connection = hyper::upgrade::on(response)
        .await
        .map_err(|e| error_chain(&e))?;
    let mut bytes = TokioIo::new(connection).take(length);
    out.clear();
    out.reserve_exact(length as usize);
    while bytes.read_buf(&mut out).await.map_err(|e| e.to_string())? > 0 {}
    if out.len() as u64 != length {
        return Err(format!("the exporter sent {} of {length} bytes", out.len()));
    }
    Ok(out)
}

/// Sends `GET url` and returns the KV of a 200 (see [`read_body`]) or a 101 (see [`read_raw`])
/// in `buffer`, bounded by `deadline` (plus a second for the bytes); a 404 means P did not
/// publish in time.
pub(crate) async fn held_get(
    http: &PullClient,
    url: &str,
    (addr, transfer_id): (&str, &str),
    deadline: Duration,
    buffer: Vec<u8>,
) -> Result<Vec<u8>, TransferError> {
    let started = Instant::now();
    let unreachable = |reason: String| TransferError::Unreachable {
        addr: addr.to_owned(),
        transfer_id: transfer_id.to_owned(),
        reason,
    };
    let not_published = || TransferError::NotPublished {
        addr: addr.to_owned(),
        transfer_id: transfer_id.to_owned(),
        waited: started.elapsed(),
    };
    // The exporter answers at the latest when the wait ends; allow a little for the bytes.
    let call = async {
        let response = http.send(Method::GET, url).await.map_err(unreachable)?;
        match response.status() {
            StatusCode::OK => read_body(response, MAX_PULL_BYTES, buffer)
                .await
                .map_err(unreachable),
            StatusCode::SWITCHING_PROTOCOLS => read_raw(response, MAX_PULL_BYTES, buffer)
                .await
                .map_err(unreachable),
            StatusCode::NOT_FOUND => Err(not_published()),
            other => Err(unreachable(format!("exporter answered {other}"))),
        }
    };
    match tokio::time::timeout(deadline.saturating_add(Duration::from_secs(1)), call).await {
        Ok(result) => result,
        Err(_) => Err(not_published()),
    }
}
