//! The warm-up of a transfer path: one request of one token through a (prefill, dp rank) pair
//! and a decode, P and D at once as a client's request goes, before an engine takes a duty in
//! which it uses that path. A connector's first use of a path between two engines can take
//! seconds (vLLM's Mooncake connector took 10.9 s on its CPU build); the warm-up pays it.

use std::time::Duration;

use reqwest::header::CONTENT_TYPE;

use crate::backend::{Backend, Pair};
use crate::body::{self, Body};

/// One warm-up request through `pair` and `decode` for `model` (when known), within
/// `timeout`: `Ok` when both answered 200.
pub async fn warm(
    client: &reqwest::Client,
    pair: &Pair,
    decode: &Backend,
    model: Option<&str>,
    timeout: Duration,
) -> Result<(), String> {
    let transfer_id = format!("pd-warmup-{:016x}", rand_id());
    let mut raw = serde_json::json!({"prompt": "warm-up", "max_tokens": 1, "temperature": 0});
    if let Some(model) = model {
        raw["model"] = model.into();
    }
    let raw = raw.to_string();
    let client_body = Body::parse(raw.as_bytes()).expect("a JSON object");
    let prefill_body = client_body.prefill(&body::prefill_params(&transfer_id, false));
    let decode_body = client_body.decode(&body::decode_params(&transfer_id, pair));
    let post = |url: &reqwest::Url, body: Vec<u8>| {
        client
            .post(url.clone())
            .header(CONTENT_TYPE, "application/json")
            .header("x-request-id", &transfer_id)
            .timeout(timeout)
            .body(body)
    };
    let prefill = post(pair.backend.completions_url.url(), prefill_body)
        .header("x-data-parallel-rank", pair.rank_header.clone());
    let decode_call = post(decode.completions_url.url(), decode_body);
    let (prefill, decode_answer) = tokio::join!(answered(prefill), answered(decode_call));
    prefill.map_err(|err| format!("prefill {}: {err}", pair.backend.url()))?;
    decode_answer.map_err(|err| format!("decode {}: {err}", decode.url()))
}

/// Sends `request` and reads its answer whole: `Ok` on a 200.
async fn answered(request: reqwest::RequestBuilder) -> Result<(), String> {
    let response = request.send().await.map_err(|err| err.to_string())?;
    let status = response.status();
    let text = response.text().await.map_err(|err| err.to_string())?;
    match status.is_success() {
        true => Ok(()),
        false => Err(format!(
            "{status}: {}",
            text.chars().take(200).collect::<String>()
        )),
    }
}

/// A transfer id's random part: the clock's nanoseconds mixed with a counter.
fn rand_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    nanos ^ NEXT.fetch_add(1, Ordering::Relaxed).rotate_left(32)
}
