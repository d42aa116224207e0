//! P and D at the same time (vLLM's Mooncake proxy): P computes the prompt's KV under a transfer
//! id while D already waits to pull it; D's answer is relayed once its first bytes are in. Should
//! D fail because P re-registered under a new engine id, D is asked again with that id.

use bytes::Bytes;

use super::{Call, Refusal, Started};
use pd_router::body::{self, Body};

/// Runs the concurrent flow.
pub(super) async fn run(call: Call<'_>, body: &Body<'_>) -> Result<Started, Refusal> {
    let decode_body = Bytes::from(body.decode(&body::decode_params(&call.transfer_id, &call.pair)));
    let prefill_body = Bytes::from(body.prefill(&body::prefill_params(&call.transfer_id, false)));
    let prefill = call.prefill(prefill_body);
    let overhead = call.start().elapsed();
    // D's body should the pair's engine turn out to have re-registered under another id.
    let bootstrap = call.pair.bootstrap_addr.as_deref().unwrap_or_default();
    let reroute = |engine_id: &str| {
        let params = body::decode_params_from(&call.transfer_id, bootstrap, engine_id);
        Bytes::from(body.decode(&params))
    };
    call.decode(
        body,
        decode_body,
        Some(prefill),
        None,
        overhead,
        Some(&reroute),
    )
    .await
}
