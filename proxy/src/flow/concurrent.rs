//! P and D at the same time (vLLM's Mooncake proxy): P computes the prompt's KV under a transfer
//! id while D already waits to pull it; D's answer is relayed once its first bytes are in.

use bytes::Bytes;

use super::retry::decode_with_retry;
use super::{Call, Refusal, Started};
use crate::body::{self, Body};
use crate::routing::RequestInfo;

/// Runs the concurrent flow.
pub(super) async fn run(call: Call<'_>, mut body: Body) -> Result<Started, Refusal> {
    let decode_body = Bytes::from(body::decode_body(
        &mut body,
        body::decode_params(&call.transfer_id, &call.pair),
    ));
    let prefill_body = Bytes::from(body::prefill_body(
        &mut body,
        body::prefill_params(&call.transfer_id, false),
    ));
    let prefill = call.prefill(prefill_body);
    let overhead = call.start.elapsed();
    let request = RequestInfo::new(&body, call.headers);
    let (decode, prefill) = decode_with_retry(
        call.state,
        call.route,
        &call.pair,
        call.decode.clone(),
        &call.common,
        decode_body,
        Some(prefill),
        &request,
    )
    .await?;
    Ok(Started {
        decode,
        prefill,
        overhead,
    })
}
