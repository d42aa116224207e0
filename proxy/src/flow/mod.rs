//! The per-request flow of `POST /v1/completions` and `POST /v1/chat/completions`, from the parsed
//! body to D's answer beginning: the policies choose a (prefill, dp rank) pair and a decode,
//! then [`concurrent`] (P and D at once, the Mooncake way) or [`sequential`] (P first, its
//! `kv_transfer_params` handed to D, the NIXL way) calls them, and [`retry`] gives D one retry on
//! another decode. Every call ends by the request's deadline (`--request-timeout` from its
//! arrival). Every future is owned by the request, so a client that goes away cancels both
//! calls.

mod adapter;
mod concurrent;
mod decode_only;
mod failure;
mod retry;
mod sequential;
mod sglang;
mod unknown_engine;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use bytes::Bytes;

pub use failure::Refusal;
use failure::{no_decode, no_prefill, prefill_failure, refused};
use retry::{DecodeCall, Decoding};

use crate::backend::Pair;
use crate::body::{raw_json, Body, Edit};
use crate::config::Mode;
use crate::ids::X_REQUEST_ID;
use crate::intake::IntakeError;
use crate::metrics::{Outcome, RouteMetrics};
use crate::relay::{PrefillCall, Tracker};
use crate::routing::decision::{self, Path, Reason, X_PD_ROUTE};
use crate::routing::queued_work::Pending;
use crate::routing::RequestInfo;
use crate::state::{AppState, Route};
use crate::trace::Phase;
use crate::upstream::DecodeStart;

/// `X-data-parallel-rank`: which dp rank of P serves the request.
pub static X_DATA_PARALLEL_RANK: HeaderName = HeaderName::from_static("x-data-parallel-rank");

/// D answered; its body can be relayed.
pub struct Started {
    /// D's answer so far.
    pub decode: DecodeStart,
    /// D's call, to be finished when its answer ends.
    pub decode_call: crate::backend::Call,
    /// P's call, when it is still running.
    pub prefill: Option<PrefillCall>,
    /// The proxy's own time before D's call was issued.
    pub overhead: Duration,
    /// The routing decision, for the answer's `x-pd-route` header (when the client asked).
    pub route: Option<HeaderValue>,
}

/// What both flows need to call P and D.
struct Call<'a> {
    state: &'a AppState,
    route: Route,
    pair: Arc<Pair>,
    decode: Arc<crate::backend::Backend>,
    /// Headers both P and D get.
    common: HeaderMap,
    transfer_id: String,
    headers: &'a HeaderMap,
    /// The prompt's token ids, when a policy needs them (for D's retry).
    tokens: Option<&'a [u32]>,
    /// The request's share of its prefill's queued work (precise_prefix), until P's call ends.
    prefill_work: std::sync::Mutex<Option<Pending>>,
    /// P's phase of the request's trace (with traces on), until P's call ends.
    prefill_phase: std::sync::Mutex<Option<Phase>>,
    /// The model asked for (after aliases), if any.
    model: Option<&'a str>,
    /// That model, when it is a LoRA adapter whose blocks a policy matches (tokens known).
    adapter: Option<&'a str>,
    /// The route's metrics for that model.
    metrics: Arc<RouteMetrics>,
    start: Instant,
    /// When the whole request must be over.
    deadline: Instant,
}

impl Call<'_> {
    /// P's headers: the common ones and the dp rank.
    fn prefill_headers(&self) -> HeaderMap {
        let mut headers = self.common.clone();
        headers.insert(X_DATA_PARALLEL_RANK.clone(), self.pair.rank_header.clone());
        headers
    }

    /// Starts P's call; its errors become what the client is told.
    fn prefill(&self, body: Bytes) -> PrefillCall {
        let call = self.pair.call();
        let pair = self.pair.clone();
        let state = self.state.clone();
        let metrics = self.metrics.clone();
        let (route, mut headers, deadline) = (self.route, self.prefill_headers(), self.deadline);
        let work = crate::sync::lock(&self.prefill_work).take();
        let phase = crate::sync::lock(&self.prefill_phase).take();
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
}

impl Call<'_> {
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
        let request = RequestInfo::new(body, self.headers)
            .with_tokens(self.tokens)
            .with_adapter(self.adapter);
        let decoding = retry::decode_with_retry(DecodeCall {
            state: self.state,
            route: self.route,
            model: self.model.or(self.pair.model.as_deref()),
            metrics: &self.metrics,
            pair: Some(&self.pair),
            decode: self.decode.clone(),
            common: &self.common,
            body: decode_body,
            request: &request,
            deadline: self.deadline,
            prefill,
            prefilled,
            streamed: streams(body),
            reroute,
        })
        .await?;
        Ok(Started::new(decoding, overhead))
    }
}

impl Started {
    /// D's answer, begun after `overhead` of the proxy's own time.
    fn new(decoding: Decoding, overhead: Duration) -> Self {
        Started {
            decode: decoding.answer,
            decode_call: decoding.call,
            prefill: decoding.prefill,
            overhead,
            route: None,
        }
    }
}

/// Parses the client's body, chooses P and D and starts the mode's flow; returns once D's answer
/// has begun (or the request failed).
pub async fn start(
    state: &AppState,
    route: Route,
    headers: &HeaderMap,
    request_id: &HeaderValue,
    body: axum::body::Body,
    tracker: &mut Tracker,
) -> Result<Started, Refusal> {
    let start = tracker.started();
    let raw = state.intake.read(body).await.map_err(|err| match err {
        IntakeError::TooLarge { .. } => refused(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            err.to_string(),
            Outcome::BadRequest,
        ),
        IntakeError::Timeout(_) => refused(
            StatusCode::REQUEST_TIMEOUT,
            "timeout",
            err.to_string(),
            Outcome::ClientTimeout,
        ),
        IntakeError::Broken(_) => refused(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            err.to_string(),
            Outcome::BadRequest,
        ),
    })?;
    // The parsed body borrows from these bytes.
    let bytes = raw.release();
    let unusable = |err: crate::body::BodyError| {
        refused(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            err.to_string(),
            Outcome::BadRequest,
        )
    };
    let parsed = Body::parse(&bytes).map_err(unusable)?;
    let asked = adapter::requested(route, &parsed);
    let model = asked
        .as_deref()
        .map(|m| state.models.canonical(m).to_owned());
    let aliased = match (&asked, &model) {
        (Some(asked), Some(model)) if asked != model => {
            let field = match parsed.get("model") {
                Some(_) => "model",
                None => "lora_path",
            };
            Some(Bytes::from(
                parsed.render(&[Edit::Replace(field, &raw_json(model))]),
            ))
        }
        _ => None,
    };
    let bytes = aliased.as_ref().unwrap_or(&bytes);
    let body = match &aliased {
        Some(rewritten) => Body::parse(rewritten).map_err(unusable)?,
        None => parsed,
    };
    let model = model.as_deref();
    let handles = state.model_metrics(model);
    tracker.retarget(handles.route(route).clone());
    let pairs = state.pool.pairs();
    let tokens = match &state.prompt_tokens {
        Some(prompt_tokens) if state.tokenize_requests => {
            let decodes = state.pool.decodes();
            let engine = decodes.iter().find(|d| d.is_healthy());
            prompt_tokens
                .of(route.prompt_kind(), bytes, &body, engine.map(|e| &**e))
                .await
        }
        _ => None,
    };
    let adapter = model.filter(|model| tokens.is_some() && state.is_adapter(model));
    let request = RequestInfo::new(&body, headers)
        .with_tokens(tokens.as_deref())
        .with_adapter(adapter);
    let deadline = start + state.upstream.request_timeout;
    let pick_started = tracker.trace().map(|_| SystemTime::now());
    let early = decision::before_pick(&state.decode_only, &request, || {
        state.decode_share(model, &request)
    });
    let pair = match (early, model) {
        (Some(_), _) => None,
        (None, None) => state.pick_pair(&pairs, None, &request),
        (None, Some(model)) => {
            adapter::load_if_missing(state, &pairs, model, headers, deadline).await?;
            let pair = state.pick_pair(&pairs, Some(model), &request);
            if pair.is_none() {
                adapter::check_served(state, &pairs, model)?;
            }
            pair
        }
    };
    let decision =
        early.unwrap_or_else(|| decision::after_pick(&state.decode_only, pair.is_some()));
    handles.decisions.count(decision);
    let explain = headers.contains_key(&X_PD_ROUTE);
    let told =
        |refusal: Refusal| explained(refusal, explain.then(|| decision.header(None, None, "")));
    let (pair, decode) = match (decision.path, pair) {
        (Path::Disaggregated, Some(pair)) => {
            let decode = pick_decode_for(state, &pair, model, &request).map_err(told)?;
            (Some(pair), decode)
        }
        (Path::DecodeOnly, _) => {
            if decision.reason == Reason::NoPrefillHealthy {
                tracing::warn!(
                    "no prefill can take the request: serving it on a decode alone \
                     (--fallback decode-only)"
                );
            }
            let decode = state
                .pick_decode(None, model, &request)
                .ok_or_else(|| match model {
                    Some(model) => adapter::model_unavailable(model, "decode"),
                    None => no_decode(),
                })
                .map_err(told)?;
            (None, decode)
        }
        _ => {
            return Err(told(match model {
                Some(model) => adapter::model_unavailable(model, "prefill"),
                None => no_prefill(pairs.is_empty()),
            }))
        }
    };
    if let (Some(trace), Some(started)) = (tracker.trace(), pick_started) {
        let prefill = pair.as_ref().map(|p| (p.backend.url(), p.dp_rank));
        trace.picked(started, decision, prefill, Some(decode.url()), model);
    }
    let route_header = explain.then(|| {
        let prefill = pair.as_ref().map(|p| (p.backend.url(), p.dp_rank));
        let notes = match model {
            Some(model) => format!("; model={model}{}", request.pick_notes()),
            None => request.pick_notes(),
        };
        decision.header(prefill, Some(decode.url()), &notes)
    });
    let mut common = HeaderMap::with_capacity(4);
    common.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    common.insert(X_REQUEST_ID.clone(), request_id.clone());
    if let Some(authorization) = headers.get(AUTHORIZATION) {
        common.insert(AUTHORIZATION, authorization.clone());
    }
    // D's phase: what `common` carries to D (P's headers get P's phase instead).
    let decode_phase = tracker
        .trace()
        .map(|trace| trace.phase("decode", decode.url()));
    match &decode_phase {
        Some(phase) => phase.inject(&mut common),
        None => crate::trace::pass_through(headers, &mut common),
    }
    let Some(pair) = pair else {
        let alone = decode_only::Alone {
            model,
            metrics: handles.route(route),
            start,
        };
        let started = decode_only::run(state, route, decode, &common, body, headers, alone).await;
        end_phase(decode_phase, &started);
        return with_route(started, route_header);
    };
    let prefill_phase = tracker
        .trace()
        .map(|trace| trace.phase("prefill", pair.backend.url()));
    let call = Call {
        state,
        route,
        pair,
        decode,
        common,
        transfer_id: format!("xfer-{}", state.ids.next()),
        prefill_phase: std::sync::Mutex::new(prefill_phase),
        headers,
        tokens: tokens.as_deref(),
        prefill_work: std::sync::Mutex::new(request.take_prefill_work()),
        model,
        adapter,
        metrics: handles.route(route).clone(),
        start,
        deadline,
    };
    if let Some(trace) = tracker.trace() {
        trace.transfer(&call.transfer_id);
    }
    let started = match state.mode {
        Mode::Concurrent => concurrent::run(call, body).await,
        Mode::Sequential => sequential::run(call, body).await,
        Mode::Sglang => sglang::run(call, body).await,
    };
    end_phase(decode_phase, &started);
    with_route(started, route_header)
}

/// Ends D's phase of the trace at its first byte (or its failure).
fn end_phase(phase: Option<Phase>, started: &Result<Started, Refusal>) {
    if let Some(phase) = phase {
        phase.end(started.as_ref().err().map(|r| r.outcome.as_str().into()));
    }
}

/// Whether the client asked for a streamed answer (`"stream": true`).
fn streams(body: &Body<'_>) -> bool {
    body.get("stream")
        .is_some_and(|value| value.get() == "true")
}

/// A healthy decode for the request's model (else `pair`'s), or why there is none: the
/// model's decodes are all down (503 naming it), or no decode serves it (a model mismatch).
fn pick_decode_for(
    state: &AppState,
    pair: &Pair,
    model: Option<&str>,
    request: &RequestInfo<'_>,
) -> Result<Arc<crate::backend::Backend>, Refusal> {
    let model = model.or(pair.model.as_deref());
    state.pick_decode(None, model, request).ok_or_else(|| {
        let decodes = &state.pool.decodes();
        if let Some(model) = model.filter(|m| decodes.iter().any(|d| d.lists(m) == Some(true))) {
            // Decodes of the model exist: they are down or drained.
            return adapter::model_unavailable(model, "decode");
        }
        let healthy = state.pool.decodes().iter().any(|d| d.is_healthy());
        match model {
            Some(model) if healthy => refused(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                format!(
                    "no healthy decode serves model {model:?}, which prefill {} (dp rank {}) \
                     serves: P and D of different models are never paired (see GET /ready)",
                    pair.backend.url(),
                    pair.dp_rank
                ),
                Outcome::ModelMismatch,
            ),
            _ => no_decode(),
        }
    })
}

/// `refusal` with the `x-pd-route` header when the client asked.
fn explained(mut refusal: Refusal, route: Option<HeaderValue>) -> Refusal {
    if let Some(route) = route {
        refusal
            .response
            .headers_mut()
            .insert(X_PD_ROUTE.clone(), route);
    }
    refusal
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
