//! Calling D, and the one retry on another decode when D fails before its first byte, while
//! P's call (concurrent mode) is watched: if P fails first, D is dropped (cancelled) and the
//! client is told at once.

use std::sync::Arc;

use axum::http::HeaderMap;
use bytes::Bytes;

use super::failure::{decode_refusal, Refusal};
use crate::backend::{Backend, Pair};
use crate::relay::PrefillCall;
use crate::routing::RequestInfo;
use crate::state::{Route, Shared};
use crate::upstream::DecodeStart;

/// D's answer has begun; P's call when it is still running.
pub type Decoding = (DecodeStart, Option<PrefillCall>);

/// Sends `body` to `decode` (and once more to another decode if that fails retryably before
/// its first byte), racing `prefill` when it is given; `pair` is the prefill D pulls from (none
/// when D serves the request alone).
#[allow(clippy::too_many_arguments)]
pub async fn decode_with_retry(
    state: &Shared,
    route: Route,
    pair: Option<&Pair>,
    mut decode: Arc<Backend>,
    common: &HeaderMap,
    body: Bytes,
    mut prefill: Option<PrefillCall>,
    request: &RequestInfo<'_>,
) -> Result<Decoding, Refusal> {
    let mut retried = false;
    loop {
        let call = decode.call();
        let issued = std::time::Instant::now();
        let decoding =
            state
                .upstream
                .decode(call, route.endpoint(&decode), common.clone(), body.clone());
        let result = match prefill.as_mut() {
            None => decoding.await,
            Some(prefilling) => {
                tokio::pin!(decoding);
                tokio::select! {
                    biased;
                    prefilled = prefilling => match prefilled {
                        // D is dropped, and so cancelled, on the way out.
                        Err(failure) => return Err(Refusal::from(failure)),
                        Ok(_) => {
                            prefill = None;
                            decoding.await
                        }
                    },
                    decoded = &mut decoding => decoded,
                }
            }
        };
        let err = match result {
            Ok(started) => {
                let waited = started.first_at.saturating_duration_since(issued);
                state.route_metrics(route).decode_first_byte(waited);
                return Ok((started, prefill));
            }
            Err(err) => err,
        };
        if let Some(pair) = pair.filter(|_| err.is_unknown_engine()) {
            tracing::debug!(
                decode = decode.url(),
                engine = pair.engine_id.as_deref(),
                "decode did not find the remote engine; rediscovering its prefill"
            );
            state.pool.prefills[pair.prefill_index].refresh.notify_one();
        }
        if !retried && err.retryable() {
            let model = pair.and_then(|pair| pair.model.as_deref());
            if let Some(next) = state.pick_decode(Some(&decode), model, request) {
                tracing::debug!(decode = decode.url(), error = %err, "decode failed before its first byte; retrying");
                state.route_metrics(route).retry();
                decode = next;
                retried = true;
                continue;
            }
        }
        return Err(decode_refusal(&decode, err));
    }
}
