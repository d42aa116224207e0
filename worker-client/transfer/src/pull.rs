//! The pull protocol both transports share: D asks the exporter's HTTP listener for
//! `GET /kv/{transfer_id}?wait_ms=N`, which the exporter holds open until P publishes the KV or
//! the wait ends (404). Over TCP the answer is the KV itself; over UCX it is the descriptor D then
//! reads one-sidedly.

use std::time::{Duration, Instant};

use bytes::Bytes;
use reqwest::StatusCode;
use serde::Deserialize;

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

/// Sends `GET url` and returns the body of a 200, bounded by `deadline` (plus a second for the
/// bytes); a 404 means P did not publish in time.
pub(crate) async fn held_get(
    http: &reqwest::Client,
    url: &str,
    addr: &str,
    transfer_id: &str,
    deadline: Duration,
) -> Result<Bytes, TransferError> {
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
        let response = http
            .get(url)
            .send()
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        match response.status() {
            StatusCode::OK => response
                .bytes()
                .await
                .map_err(|e| unreachable(e.to_string())),
            StatusCode::NOT_FOUND => Err(not_published()),
            other => Err(unreachable(format!("exporter answered {other}"))),
        }
    };
    match tokio::time::timeout(deadline.saturating_add(Duration::from_secs(1)), call).await {
        Ok(result) => result,
        Err(_) => Err(not_published()),
    }
}
