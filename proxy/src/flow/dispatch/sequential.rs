//! P first, then D (vLLM's NIXL proxy): P's answer carries the `kv_transfer_params` D needs. A P
//! that ended before its cap sent no KV (nor those parameters): the decode then serves alone.

use std::time::Instant;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::Value;

use super::prefill_finish::{prefill_stopped, stopped_before_cap};
use super::{Call, Refusal, Started};
use crate::error::ApiError;
use crate::metrics::Outcome;
use pd_router::body::{self, Body};

/// The field of P's answer sequential mode needs.
#[derive(Deserialize)]
struct PrefillAnswer {
    kv_transfer_params: Option<Value>,
}

/// Runs the sequential flow.
pub(super) async fn run(call: Call<'_>, body: &Body<'_>) -> Result<Started, Refusal> {
    let prefill_body = Bytes::from(body.prefill(&body::prefill_params(&call.transfer_id, true)));
    let before_prefill = call.start().elapsed();
    let answer = call.prefill(prefill_body).await.map_err(Refusal::from)?;
    let answered = Instant::now();
    if let Some(reason) = stopped_before_cap(&answer) {
        // P sent no KV (and so no kv_transfer_params): the decode serves the request alone.
        prefill_stopped(&call.request.metrics, &call.pair, &call.decode, &reason);
        let alone = Bytes::from(body.alone());
        let overhead = before_prefill + answered.elapsed();
        return call.decode(body, alone, None, None, overhead, None).await;
    }
    let params = serde_json::from_slice::<PrefillAnswer>(&answer)
        .ok()
        .and_then(|answer| answer.kv_transfer_params)
        .filter(Value::is_object)
        .ok_or_else(|| {
            let who = format!(
                "prefill {} (dp rank {})",
                call.pair.backend.url(),
                call.pair.dp_rank
            );
            Refusal::from((
                ApiError::bad_gateway(
                    "the prefill answered without kv_transfer_params, which sequential mode \
                     hands to the decode (does the prefill run a connector that returns them, \
                     such as NIXL?)",
                )
                .failed_at(who),
                Outcome::PrefillError,
            ))
        })?;
    let decode_body = Bytes::from(body.decode(&body::raw_json(&params)));
    let overhead = before_prefill + answered.elapsed();
    // D's first byte is due --decode-first-byte-timeout after P's answer.
    call.decode(body, decode_body, None, Some(answered), overhead, None)
        .await
}
