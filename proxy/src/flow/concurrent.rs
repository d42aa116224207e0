//! P and D at the same time (vLLM's Mooncake proxy): P computes the prompt's KV under a transfer
//! id while D already waits to pull it; D's answer is relayed once its first bytes are in.

use bytes::Bytes;

use super::{Call, Refusal, Started};
use crate::body::{self, Body};

/// Runs the concurrent flow.
pub(super) async fn run(call: Call<'_>, body: Body<'_>) -> Result<Started, Refusal> {
    let decode_body = Bytes::from(body.decode(&body::decode_params(&call.transfer_id, &call.pair)));
    let prefill_body = Bytes::from(body.prefill(&body::prefill_params(&call.transfer_id, false)));
    let prefill = call.prefill(prefill_body);
    let overhead = call.start.elapsed();
    call.decode(&body, decode_body, Some(prefill), None, overhead)
        .await
}
