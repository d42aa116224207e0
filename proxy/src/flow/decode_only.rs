//! A decode alone (conditional disaggregation, or the decode-only fallback): D computes the
//! prompt itself and generates; no prefill, no KV transfer.

use std::time::Instant;

use axum::http::HeaderMap;
use bytes::Bytes;

use super::retry::{self, DecodeCall};
use super::{Refusal, Started};
use crate::backend::Backend;
use crate::body::Body;
use crate::metrics::RouteMetrics;
use crate::routing::RequestInfo;
use crate::state::{AppState, Route};

/// What a request served by a decode alone carries besides its body.
pub(super) struct Alone<'a> {
    /// The model asked for, if any.
    pub model: Option<&'a str>,
    /// The route's metrics for that model.
    pub metrics: &'a RouteMetrics,
    /// When the request arrived.
    pub start: Instant,
}

/// Sends the client's body, without transfer instructions, to `decode` (one retry on another
/// decode of the same model). Without P there is no first-byte deadline: D computes the
/// prompt itself, within the request's deadline.
pub(super) async fn run(
    state: &AppState,
    route: Route,
    decode: std::sync::Arc<Backend>,
    common: &HeaderMap,
    body: Body<'_>,
    headers: &HeaderMap,
    how: Alone<'_>,
) -> Result<Started, Refusal> {
    let Alone {
        model,
        metrics,
        start,
    } = how;
    let alone = Bytes::from(body.alone());
    let overhead = start.elapsed();
    let request = RequestInfo::new(&body, headers);
    let decoding = retry::decode_with_retry(DecodeCall {
        state,
        route,
        model,
        metrics,
        pair: None,
        decode,
        common,
        body: alone,
        request: &request,
        deadline: start + state.upstream.request_timeout,
        prefill: None,
        prefilled: None,
        streamed: false,
        reroute: None,
    })
    .await?;
    Ok(Started::new(decoding, overhead))
}
