//! The third stage: P and D called as `--mode` says, one file per mode: [`concurrent`] (P and D
//! at once, the Mooncake way), [`sequential`] (P first, its `kv_transfer_params` handed to D,
//! the NIXL way), [`sglang`] (P and D at once with SGLang's bootstrap fields), and
//! [`decode_only`] (a decode alone). [`retry`] gives D one retry on another decode;
//! [`unknown_engine`] re-sends to the same D once when P re-registered under a new engine id;
//! [`prefill_finish`] tells a P that ended before its cap (and so sent no KV), which the decode
//! then serves alone.

mod concurrent;
mod decode_only;
mod prefill_finish;
mod retry;
mod sequential;
mod sglang;
mod unknown_engine;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;
use pd_router::backend::{Backend, Pair, Reservation};
use pd_router::body::Body;
use pd_router::placement::Forecast;
use pd_router::routing::queued_work::Pending;
use pd_router::routing::RequestInfo;
use pd_router::sync::lock;

use super::failure::{prefill_failure, Refusal};
use super::placement::{explained, Placed};
use super::{Request, Started};
use crate::config::Mode;
use crate::ids::X_REQUEST_ID;
use crate::relay::PrefillCall;
use crate::trace::{Phase, RequestTrace};
use retry::{DecodeCall, Decoding};

/// `X-data-parallel-rank`: which dp rank of P serves the request.
static X_DATA_PARALLEL_RANK: HeaderName = HeaderName::from_static("x-data-parallel-rank");

/// `X-Session-ID`: the session vLLM tags the request's KV events with, passed on to both.
static X_SESSION_ID: HeaderName = HeaderName::from_static("x-session-id");

/// Calls the placed request's backends: a decode alone, or P and D as `--mode` says.
pub(super) async fn run(
    request: &Request<'_>,
    body: &Body<'_>,
    placed: Placed,
    trace: Option<&RequestTrace>,
) -> Result<Started, Refusal> {
    let state = request.state;
    let Placed {
        placement,
        tokens,
        adapter,
        prefill_work,
        route_header,
        reserved,
    } = placed;
    let (decode, forecast) = (placement.decode, placement.forecast);
    let streamed = streams(body);
    let mut common = HeaderMap::with_capacity(5);
    common.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    common.insert(X_REQUEST_ID.clone(), request.request_id.clone());
    if let Some(authorization) = request.headers.get(AUTHORIZATION) {
        common.insert(AUTHORIZATION, authorization.clone());
    }
    // vLLM (0.33) tags the request's KV events with it: both engines get the client's.
    if let Some(session) = request.headers.get(&X_SESSION_ID) {
        common.insert(X_SESSION_ID.clone(), session.clone());
    }
    // D's phase: what `common` carries to D (P's headers get P's phase instead).
    let decode_phase = trace.map(|trace| trace.phase("decode", decode.url()));
    match &decode_phase {
        Some(phase) => phase.inject(&mut common),
        None => crate::trace::pass_through(request.headers, &mut common),
    }
    let Some(pair) = placement.prefill else {
        let started = decode_only::run(request, decode, reserved.decode, &common, body).await;
        end_phase(decode_phase, &started);
        return with_route(started, route_header).map(|s| s.watched(forecast, streamed));
    };
    let prefill_phase = trace.map(|trace| trace.phase("prefill", pair.backend.url()));
    let call = Call {
        request,
        pair,
        decode,
        common,
        transfer_id: format!("xfer-{}", state.ids.next()),
        prefill_phase: Mutex::new(prefill_phase),
        tokens: tokens.as_deref(),
        prefill_work: Mutex::new(prefill_work),
        adapter: request.model.filter(|_| adapter),
        decode_reserved: Mutex::new(reserved.decode),
        prefill_reserved: Mutex::new(reserved.prefill),
    };
    if let Some(trace) = trace {
        trace.transfer(&call.transfer_id);
    }
    let started = match state.mode {
        Mode::Concurrent => concurrent::run(call, body).await,
        Mode::Sequential => sequential::run(call, body).await,
        Mode::Sglang => sglang::run(call, body).await,
    };
    end_phase(decode_phase, &started);
    with_route(started, route_header).map(|s| s.watched(forecast, streamed))
}

/// What the P/D modes need to call P and D.
struct Call<'a> {
    request: &'a Request<'a>,
    pair: Arc<Pair>,
    decode: Arc<Backend>,
    /// Headers both P and D get.
    common: HeaderMap,
    transfer_id: String,
    /// The prompt's token ids, when a policy needs them (for D's retry).
    tokens: Option<&'a [u32]>,
    /// The request's share of its prefill's queued work (precise_prefix), until P's call ends.
    prefill_work: Mutex<Option<Pending>>,
    /// P's phase of the request's trace (with traces on), until P's call ends.
    prefill_phase: Mutex<Option<Phase>>,
    /// The model, when it is a LoRA adapter whose blocks a policy matches (tokens known).
    adapter: Option<&'a str>,
    /// The request counted on its decode until D's call is made.
    decode_reserved: Mutex<Option<Reservation>>,
    /// The request counted on its prefill until P's call is made.
    prefill_reserved: Mutex<Option<Reservation>>,
}

impl Call<'_> {
    /// When the request arrived.
    fn start(&self) -> Instant {
        self.request.start
    }

    /// P's headers: the common ones and the dp rank.
    fn prefill_headers(&self) -> HeaderMap {
        let mut headers = self.common.clone();
        headers.insert(X_DATA_PARALLEL_RANK.clone(), self.pair.rank_header.clone());
        headers
    }

    /// Starts P's call; its errors become what the client is told.
    fn prefill(&self, body: Bytes) -> PrefillCall {
        let call = self.pair.call();
        drop(lock(&self.prefill_reserved).take());
        let pair = self.pair.clone();
        let state = self.request.state.clone();
        let metrics = self.request.metrics.clone();
        let (route, mut headers) = (self.request.route, self.prefill_headers());
        let deadline = self.request.deadline;
        let work = lock(&self.prefill_work).take();
        let phase = lock(&self.prefill_phase).take();
        if let Some(phase) = &phase {
            phase.inject(&mut headers);
        }
        Box::pin(async move {
            let _work = work;
            let started = Instant::now();
            let endpoint = route.endpoint(&pair.backend);
            let answered = state
                .upstream
                .prefill(call, endpoint, headers, body, deadline)
                .await;
            metrics.prefill_answered(started.elapsed());
            if let Some(phase) = phase {
                phase.end(answered.as_ref().err().map(|err| err.to_string().into()));
            }
            answered.map_err(|err| prefill_failure(&pair, &err))
        })
    }

    /// Calls D with `decode_body` (racing `prefill` when given; `prefilled` when P already
    /// answered) and returns once its answer has begun; `body` is the client's, for the decode
    /// policy should D be retried; `reroute` makes D's body for another engine id of the pair.
    async fn decode(
        &self,
        body: &Body<'_>,
        decode_body: Bytes,
        prefill: Option<PrefillCall>,
        prefilled: Option<Instant>,
        overhead: Duration,
        reroute: Option<&(dyn Fn(&str) -> Bytes + Sync)>,
    ) -> Result<Started, Refusal> {
        let request = RequestInfo::new(body, self.request.headers)
            .with_tokens(self.tokens)
            .with_adapter(self.adapter);
        let reserved = lock(&self.decode_reserved).take();
        // vLLM's P sends no KV when it ends before its cap: the decode then serves alone.
        let alone = || Bytes::from(body.alone());
        let vllm = self.request.state.mode != Mode::Sglang;
        let decoding = retry::decode_with_retry(DecodeCall {
            state: self.request.state,
            route: self.request.route,
            model: self.request.model.or(self.pair.model.as_deref()),
            metrics: &self.request.metrics,
            pair: Some(&self.pair),
            decode: self.decode.clone(),
            common: &self.common,
            body: decode_body,
            request: &request,
            deadline: self.request.deadline,
            prefill,
            prefilled,
            streamed: streams(body),
            reroute,
            alone: vllm.then_some(&alone as &(dyn Fn() -> Bytes + Sync)),
            stopped: None,
            reserved,
            awaiting: None,
            avoid: self.request.avoid,
        })
        .await?;
        Ok(Started::new(decoding, overhead))
    }
}

impl Started {
    /// The same start, its answer watched by `forecast` when it streams from the decode
    /// the forecast is for.
    fn watched(self, forecast: Forecast, streamed: bool) -> Self {
        let placed = forecast.is_for(self.decode_call.backend());
        Started {
            watch: (streamed && placed).then(|| forecast.watch()),
            ..self
        }
    }

    /// D's answer, begun after `overhead` of the proxy's own time.
    fn new(decoding: Decoding, overhead: Duration) -> Self {
        Started {
            decode: decoding.answer,
            decode_call: decoding.call,
            prefill: decoding.prefill,
            overhead,
            route: None,
            watch: None,
            resume: None,
            rate: None,
        }
    }
}

/// Ends D's phase of the trace at its first byte (or its failure).
fn end_phase(phase: Option<Phase>, started: &Result<Started, Refusal>) {
    if let Some(phase) = phase {
        phase.end(started.as_ref().err().map(|r| r.outcome.as_str().into()));
    }
}

/// Whether the client asked for a streamed answer (`"stream": true`, or `"yes"`, `1`... as
/// the engine reads it).
fn streams(body: &Body<'_>) -> bool {
    body.flag("stream") == Some(true)
}

/// `started` (or its refusal) carrying the routing decision when the client asked.
fn with_route(
    started: Result<Started, Refusal>,
    route: Option<HeaderValue>,
) -> Result<Started, Refusal> {
    match started {
        Ok(started) => Ok(Started { route, ..started }),
        Err(refusal) => Err(explained(refusal, route)),
    }
}
