//! A decode alone (conditional disaggregation, or the decode-only fallback): D computes the
//! prompt itself and generates; no prefill, no KV transfer.

use std::time::Instant;

use axum::http::HeaderMap;
use bytes::Bytes;

use super::{retry, Refusal, Started};
use crate::backend::Backend;
use crate::body::Body;
use crate::routing::RequestInfo;
use crate::state::{AppState, Route};

/// Sends the client's body, without transfer instructions, to `decode` (one retry on another).
pub(super) async fn run(
    state: &AppState,
    route: Route,
    decode: std::sync::Arc<Backend>,
    common: &HeaderMap,
    body: Body<'_>,
    headers: &HeaderMap,
    start: Instant,
) -> Result<Started, Refusal> {
    let alone = Bytes::from(body.alone());
    let overhead = start.elapsed();
    let request = RequestInfo::new(&body, headers);
    let (decode, _) =
        retry::decode_with_retry(state, route, None, decode, common, alone, None, &request).await?;
    Ok(Started {
        decode,
        prefill: None,
        overhead,
        route: None,
    })
}
