//! A decode alone (conditional disaggregation, or the decode-only fallback): D computes the
//! prompt itself and generates; no prefill, no KV transfer.

use std::sync::Arc;

use axum::http::HeaderMap;
use bytes::Bytes;
use pd_router::backend::{Backend, Reservation};
use pd_router::body::Body;
use pd_router::routing::RequestInfo;

use super::retry::{self, DecodeCall};
use super::{Refusal, Request, Started};

/// Sends the client's body, without transfer instructions, to `decode` (one retry on another
/// decode of the same model). Without P there is no first-byte deadline: D computes the
/// prompt itself, within the request's deadline.
pub(super) async fn run(
    request: &Request<'_>,
    decode: Arc<Backend>,
    reserved: Option<Reservation>,
    common: &HeaderMap,
    body: &Body<'_>,
) -> Result<Started, Refusal> {
    let alone = Bytes::from(body.alone());
    let overhead = request.start.elapsed();
    let info = RequestInfo::new(body, request.headers);
    let decoding = retry::decode_with_retry(DecodeCall {
        state: request.state,
        route: request.route,
        model: request.model,
        metrics: &request.metrics,
        pair: None,
        decode,
        common,
        body: alone,
        request: &info,
        deadline: request.deadline,
        prefill: None,
        prefilled: None,
        streamed: false,
        reroute: None,
        alone: None,
        stopped: None,
        reserved,
        awaiting: None,
        avoid: request.avoid,
    })
    .await?;
    Ok(Started::new(decoding, overhead))
}
