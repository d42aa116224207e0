//! The warm-up of a transfer path: one request of one token through a (prefill, dp rank) pair
//! and a decode, P and D at once as a client's request goes, before an engine takes a duty in
//! which it uses that path. A connector's first use of a path between two engines can take
//! seconds (vLLM's Mooncake connector took 10.9 s on its CPU build); the warm-up pays it.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use reqwest::header::CONTENT_TYPE;

use super::{Dual, Duty};
use crate::backend::{Backend, Pair, Pool};
use crate::body::{self, Body};

/// A (prefill, dp rank) pair and a decode that a request may join.
pub type Path = (Arc<Pair>, Arc<Backend>);

/// Every path `engine` uses on `to` duty for `model` when each dual's duty is `duty_of`'s: as a
/// prefill, its dp ranks with each decode-only engine and each other dual on decode duty; as a
/// decode, each prefill-only engine's dp ranks and each other dual's on prefill duty.
pub fn paths(
    pool: &Pool,
    engine: &Dual,
    to: Duty,
    model: Option<&str>,
    duty_of: &dyn Fn(&Dual) -> Duty,
) -> Vec<Path> {
    let others = pool.duals();
    let others = (others.iter()).filter(|d| !std::ptr::eq(&***d, engine) && d.serves(model));
    match to {
        Duty::Prefill => {
            let fixed = (pool.decodes().iter())
                .filter(|d| !pool.is_dual(d) && d.takes_requests(model))
                .cloned()
                .collect::<Vec<_>>();
            let duals = others.filter(|d| duty_of(d) == Duty::Decode);
            let decodes = fixed.into_iter().chain(duals.map(|d| d.decode.clone()));
            let own = engine.prefill.pairs();
            decodes
                .flat_map(|d| own.iter().map(move |pair| (pair.clone(), d.clone())))
                .collect()
        }
        Duty::Decode => {
            let fixed = (pool.pairs().iter())
                .filter(|p| !pool.is_dual(&p.backend) && p.takes_requests() && p.serves(model))
                .cloned()
                .collect::<Vec<_>>();
            let duals = others.filter(|d| duty_of(d) == Duty::Prefill);
            let pairs = fixed
                .into_iter()
                .chain(duals.flat_map(|d| d.prefill.pairs()));
            pairs.map(|pair| (pair, engine.decode.clone())).collect()
        }
    }
}

/// Warms every one of `paths` at once for `model`, within `timeout` each: `Ok` when all
/// answered, else the first failure (none to warm is a failure: the duty would serve nothing).
pub async fn warm_all(
    client: &reqwest::Client,
    paths: &[Path],
    model: Option<&str>,
    timeout: Duration,
) -> Result<(), String> {
    if paths.is_empty() {
        return Err("no engine of the other duty to warm a path with".into());
    }
    let warmed = (paths.iter()).map(|(pair, decode)| warm(client, pair, decode, model, timeout));
    join_all(warmed).await.into_iter().collect()
}

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
