//! The per-request flow of `POST /v1/completions` and `POST /v1/chat/completions`, and the
//! `/v1/models` pass-through.
//!
//! Concurrent mode: choose a (prefill, dp rank) pair and a decode, build both bodies, start P and
//! D together, and answer with D's status once D's first bytes are in, while watching P: if P
//! fails first, D is dropped (cancelled) and the client gets a JSON error at once. If D fails
//! before its first byte it is retried once on another decode. Sequential mode awaits P and hands
//! the `kv_transfer_params` P returns to D. Every future and stream is owned by the request, so a
//! client that goes away cancels both calls.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body as ResponseBody;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use pd_service::BearerToken;
use serde::Deserialize;
use serde_json::Value;
use uuid::Uuid;

use crate::backend::{Backend, Pair, Pool};
use crate::body;
use crate::config::{Config, Mode};
use crate::error::ApiError;
use crate::metrics::{CallOutcome, Metrics, Outcome, RouteMetrics};
use crate::policy::Picker;
use crate::relay::{detach, Failure, PrefillCall, Relay, Tracker};
use crate::upstream::{DecodeStart, Endpoint, Upstream, UpstreamError};

/// `X-Request-Id`: kept from the client or made up, sent to P and D and back to the client.
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// `X-data-parallel-rank`: which dp rank of P serves the request.
pub static X_DATA_PARALLEL_RANK: HeaderName = HeaderName::from_static("x-data-parallel-rank");

/// Everything the handlers share.
pub struct Shared {
    /// The backends.
    pub pool: Arc<Pool>,
    /// Calls to backends.
    pub upstream: Upstream,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    pair_picker: Picker,
    decode_picker: Picker,
    completions: Arc<RouteMetrics>,
    chat_completions: Arc<RouteMetrics>,
    mode: Mode,
    /// The key clients must present, if any.
    api_key: Option<BearerToken>,
    ids: Ids,
}

/// The state every handler receives.
pub type AppState = Arc<Shared>;

/// The two proxied routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    ChatCompletions,
}

impl Route {
    fn endpoint(self, backend: &Backend) -> &Endpoint {
        match self {
            Route::Completions => &backend.completions_url,
            Route::ChatCompletions => &backend.chat_completions_url,
        }
    }
}

/// A request that ended before D's answer could be relayed.
struct Refusal {
    response: Box<Response>,
    outcome: Outcome,
}

impl From<Failure> for Refusal {
    fn from((error, outcome): Failure) -> Self {
        Refusal {
            response: Box::new(error.into_response()),
            outcome,
        }
    }
}

/// D answered; its body can be relayed.
struct Started {
    decode: DecodeStart,
    prefill: Option<PrefillCall>,
    /// The proxy's own time before D's call was issued.
    overhead: Duration,
}

impl Shared {
    /// The shared state for `config`.
    pub fn new(
        config: &Config,
        pool: Arc<Pool>,
        upstream: Upstream,
        metrics: Arc<Metrics>,
    ) -> Self {
        Shared {
            pool,
            upstream,
            pair_picker: Picker::new(config.policy),
            decode_picker: Picker::new(config.policy),
            completions: Arc::new(metrics.route("/v1/completions")),
            chat_completions: Arc::new(metrics.route("/v1/chat/completions")),
            metrics,
            mode: config.mode,
            api_key: config.api_key.as_deref().and_then(BearerToken::new),
            ids: Ids::new(),
        }
    }

    fn authorize(&self, headers: &HeaderMap) -> Result<(), Refusal> {
        if self.api_key.as_ref().is_none_or(|key| key.admits(headers)) {
            Ok(())
        } else {
            let error = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "this proxy needs the header Authorization: Bearer <key> with its --api-key",
            );
            Err(Refusal::from((error, Outcome::Unauthorized)))
        }
    }

    fn pick_pair(&self, pairs: &[Arc<Pair>]) -> Result<Arc<Pair>, Refusal> {
        self.pair_picker
            .pick(pairs, |pair| pair.backend.is_healthy(), |pair| pair.outstanding())
            .cloned()
            .ok_or_else(|| {
                let message = if pairs.is_empty() {
                    "no prefill is ready: no (prefill, dp rank) pair has been discovered yet \
                     (waiting for each prefill's /health and its bootstrap server's /query; see GET /ready)"
                } else {
                    "no prefill is ready: every prefill with discovered dp ranks is failing its \
                     health checks (see GET /ready)"
                };
                Refusal::from((ApiError::unavailable(message), Outcome::Unavailable))
            })
    }

    /// A healthy decode; for a retry (`instead_of` set) another one when there is one, else the
    /// same again.
    fn pick_decode(&self, instead_of: Option<&Arc<Backend>>) -> Option<Arc<Backend>> {
        let decodes = &self.pool.decodes;
        let load = |decode: &Arc<Backend>| decode.outstanding();
        match instead_of {
            None => self
                .decode_picker
                .pick(decodes, |decode| decode.is_healthy(), load)
                .cloned(),
            Some(failed) => self
                .decode_picker
                .pick(
                    decodes,
                    |decode| decode.is_healthy() && !Arc::ptr_eq(decode, failed),
                    load,
                )
                .cloned()
                .or_else(|| Some(failed.clone())),
        }
    }

    fn route_metrics(&self, route: Route) -> &Arc<RouteMetrics> {
        match route {
            Route::Completions => &self.completions,
            Route::ChatCompletions => &self.chat_completions,
        }
    }

    /// Starts P's call; its errors become what the client is told.
    fn prefill_call(
        self: &Arc<Self>,
        route: Route,
        pair: &Arc<Pair>,
        headers: HeaderMap,
        body: Bytes,
    ) -> PrefillCall {
        let call = pair.call();
        let pair = pair.clone();
        let shared = self.clone();
        Box::pin(async move {
            shared
                .upstream
                .prefill(call, route.endpoint(&pair.backend), headers, body)
                .await
                .map_err(|err| prefill_failure(&pair, &err))
        })
    }
}

/// What P's failure means for the client.
fn prefill_failure(pair: &Pair, err: &UpstreamError) -> Failure {
    let who = format!("prefill {} (dp rank {})", pair.backend.url(), pair.dp_rank);
    match err {
        UpstreamError::Timeout(limit) => (
            ApiError::gateway_timeout(format!("{who} did not answer within {limit:?}")),
            Outcome::PrefillTimeout,
        ),
        UpstreamError::Status { status, .. } if status.is_client_error() => (
            ApiError::new(
                *status,
                "invalid_request_error",
                format!("{who} {}", err.backend_message()),
            ),
            Outcome::PrefillError,
        ),
        UpstreamError::Status { .. } => (
            ApiError::bad_gateway(format!("{who} {}", err.backend_message())),
            Outcome::PrefillError,
        ),
        UpstreamError::Connect(_) | UpstreamError::Broken(_) => (
            ApiError::bad_gateway(format!("{who}: {err}")),
            Outcome::PrefillError,
        ),
    }
}

/// What D's failure means for the client: its own error answer is relayed as is.
fn decode_refusal(decode: &Backend, err: UpstreamError) -> Refusal {
    match err {
        UpstreamError::Status {
            status,
            content_type,
            body,
        } => {
            let mut response = (status, body).into_response();
            if let Some(content_type) = content_type {
                response.headers_mut().insert(CONTENT_TYPE, content_type);
            }
            Refusal {
                response: Box::new(response),
                outcome: if status.is_client_error() {
                    Outcome::DecodeRejected
                } else {
                    Outcome::DecodeError
                },
            }
        }
        UpstreamError::Timeout(limit) => Refusal::from((
            ApiError::gateway_timeout(format!(
                "decode {} did not answer within {limit:?}",
                decode.url()
            )),
            Outcome::DecodeTimeout,
        )),
        other => Refusal::from((
            ApiError::bad_gateway(format!("decode {}: {other}", decode.url())),
            Outcome::DecodeError,
        )),
    }
}

/// The field of P's answer sequential mode needs.
#[derive(Deserialize)]
struct PrefillAnswer {
    kv_transfer_params: Option<Value>,
}

/// Random version-4 UUIDs without a system call each (`Uuid::new_v4` asks the OS every time):
/// SipHash, keyed once from the OS, over a counter.
struct Ids {
    key: RandomState,
    counter: AtomicU64,
}

impl Ids {
    fn new() -> Self {
        Ids {
            key: RandomState::new(),
            counter: AtomicU64::new(0),
        }
    }

    fn next(&self) -> Uuid {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let high = u128::from(self.key.hash_one((n, 0u8)));
        let low = u128::from(self.key.hash_one((n, 1u8)));
        uuid::Builder::from_random_bytes(((high << 64) | low).to_be_bytes()).into_uuid()
    }
}

fn request_id(ids: &Ids, headers: &HeaderMap) -> HeaderValue {
    headers
        .get(&X_REQUEST_ID)
        .filter(|value| !value.is_empty())
        .cloned()
        .unwrap_or_else(|| {
            let mut text = [0; uuid::fmt::Hyphenated::LENGTH];
            HeaderValue::from_bytes(ids.next().hyphenated().encode_lower(&mut text).as_bytes())
                .expect("a uuid is a valid header value")
        })
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(&state, Route::Completions, &headers, body).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    serve(&state, Route::ChatCompletions, &headers, body).await
}

async fn serve(
    state: &AppState,
    route: Route,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let start = Instant::now();
    let mut tracker = Tracker::new(state.route_metrics(route).clone(), start);
    let request_id = request_id(&state.ids, headers);
    let mut response = match start_request(state, route, headers, &request_id, body, start).await {
        Ok(Started {
            decode,
            prefill,
            overhead,
        }) => {
            let first_at = decode.first_at;
            tracker.metrics().first_byte(first_at.duration_since(start));
            let status = decode.status;
            let content_type = decode.content_type.clone();
            let sse = content_type
                .as_ref()
                .is_some_and(|value| value.as_bytes().starts_with(b"text/event-stream"));
            let metrics = tracker.metrics().clone();
            let body = if decode.complete {
                // D's whole answer is in (the usual non-streamed case): send it with its length.
                decode.call.finish(CallOutcome::Ok);
                if let Some(prefill) = prefill {
                    detach(prefill);
                }
                tracker.finish(Outcome::Ok);
                ResponseBody::from(decode.first.unwrap_or_default())
            } else {
                ResponseBody::from_stream(Relay::new(decode, prefill, sse, tracker))
            };
            let mut response = Response::new(body);
            *response.status_mut() = status;
            if let Some(content_type) = content_type {
                response.headers_mut().insert(CONTENT_TYPE, content_type);
            }
            metrics.overhead(overhead + first_at.elapsed());
            response
        }
        Err(refusal) => {
            tracker.finish(refusal.outcome);
            *refusal.response
        }
    };
    response
        .headers_mut()
        .insert(X_REQUEST_ID.clone(), request_id);
    response
}

async fn start_request(
    state: &AppState,
    route: Route,
    headers: &HeaderMap,
    request_id: &HeaderValue,
    body: Result<Bytes, BytesRejection>,
    start: Instant,
) -> Result<Started, Refusal> {
    state.authorize(headers)?;
    let raw = body.map_err(|rejection| {
        Refusal::from((
            ApiError::new(
                rejection.status(),
                "invalid_request_error",
                rejection.body_text(),
            ),
            Outcome::BadRequest,
        ))
    })?;
    let mut body = body::parse(&raw).map_err(|err| {
        Refusal::from((ApiError::bad_request(err.to_string()), Outcome::BadRequest))
    })?;
    drop(raw);
    let pairs = state.pool.pairs();
    let pair = state.pick_pair(&pairs)?;
    let mut decode = state.pick_decode(None).ok_or_else(|| {
        Refusal::from((
            ApiError::unavailable(
                "no decode is ready: every decode is failing its health checks (see GET /ready)",
            ),
            Outcome::Unavailable,
        ))
    })?;
    let transfer_id = format!("xfer-{}", state.ids.next());
    let mut common = HeaderMap::with_capacity(4);
    common.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    common.insert(X_REQUEST_ID.clone(), request_id.clone());
    if let Some(authorization) = headers.get(AUTHORIZATION) {
        common.insert(AUTHORIZATION, authorization.clone());
    }
    let mut prefill_headers = common.clone();
    prefill_headers.insert(X_DATA_PARALLEL_RANK.clone(), pair.rank_header.clone());

    let (decode_body, mut prefill, overhead) = match state.mode {
        Mode::Concurrent => {
            let decode_body = Bytes::from(body::decode_body(
                &mut body,
                body::decode_params(&transfer_id, &pair),
            ));
            let prefill_body = Bytes::from(body::prefill_body(
                &mut body,
                body::prefill_params(&transfer_id, false),
            ));
            let prefill = state.prefill_call(route, &pair, prefill_headers, prefill_body);
            (decode_body, Some(prefill), start.elapsed())
        }
        Mode::Sequential => {
            let mut decode_map = body.clone();
            let prefill_body = Bytes::from(body::prefill_body(
                &mut body,
                body::prefill_params(&transfer_id, true),
            ));
            let before_prefill = start.elapsed();
            let answer = state
                .prefill_call(route, &pair, prefill_headers, prefill_body)
                .await
                .map_err(Refusal::from)?;
            let answered = Instant::now();
            let params = serde_json::from_slice::<PrefillAnswer>(&answer)
                .ok()
                .and_then(|answer| answer.kv_transfer_params)
                .filter(Value::is_object)
                .ok_or_else(|| {
                    Refusal::from((
                        ApiError::bad_gateway(format!(
                            "prefill {} (dp rank {}) answered without kv_transfer_params, which \
                             sequential mode hands to D (does P run a connector that returns them, \
                             such as NIXL?)",
                            pair.backend.url(),
                            pair.dp_rank
                        )),
                        Outcome::PrefillError,
                    ))
                })?;
            let decode_body = Bytes::from(body::decode_body(&mut decode_map, params));
            (decode_body, None, before_prefill + answered.elapsed())
        }
    };
    drop(body);

    let mut retried = false;
    loop {
        let call = decode.call();
        let decoding = state.upstream.decode(
            call,
            route.endpoint(&decode),
            common.clone(),
            decode_body.clone(),
        );
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
        match result {
            Ok(decode) => {
                return Ok(Started {
                    decode,
                    prefill,
                    overhead,
                })
            }
            Err(err) => {
                if err.is_unknown_engine() {
                    tracing::debug!(
                        decode = decode.url(),
                        engine = &*pair.engine_id,
                        "decode did not find the remote engine; rediscovering its prefill"
                    );
                    state.pool.prefills[pair.prefill_index].refresh.notify_one();
                }
                if !retried && err.retryable() {
                    if let Some(next) = state.pick_decode(Some(&decode)) {
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
    }
}

/// `GET /v1/models`: the answer of a healthy decode.
pub async fn models(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(refusal) = state.authorize(&headers) {
        return *refusal.response;
    }
    let Some(decode) = state.pick_decode(None) else {
        return ApiError::unavailable(
            "no decode is ready: every decode is failing its health checks",
        )
        .into_response();
    };
    let call = decode.call();
    let mut request = state
        .upstream
        .client
        .get(decode.models_url.clone())
        .timeout(state.upstream.request_timeout.min(Duration::from_secs(30)));
    if let Some(authorization) = headers.get(AUTHORIZATION) {
        request = request.header(AUTHORIZATION, authorization.clone());
    }
    let answer = async {
        let response = request.send().await?;
        let status = response.status();
        let content_type = response.headers().get(CONTENT_TYPE).cloned();
        Ok::<_, reqwest::Error>((status, content_type, response.bytes().await?))
    }
    .await;
    match answer {
        Ok((status, content_type, body)) => {
            call.finish(if status.is_success() {
                CallOutcome::Ok
            } else {
                CallOutcome::HttpError
            });
            let mut response = (status, body).into_response();
            if let Some(content_type) = content_type {
                response.headers_mut().insert(CONTENT_TYPE, content_type);
            }
            response
        }
        Err(err) => {
            call.finish(if err.is_timeout() {
                CallOutcome::Timeout
            } else if err.is_connect() {
                CallOutcome::ConnectError
            } else {
                CallOutcome::Error
            });
            ApiError::bad_gateway(format!(
                "decode {}: {}",
                decode.url(),
                pd_service::error_chain(&err)
            ))
            .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn ids_are_distinct_version_4_uuids() {
        let ids = Ids::new();
        let seen: HashSet<Uuid> = (0..10_000).map(|_| ids.next()).collect();
        assert_eq!(seen.len(), 10_000);
        for id in seen {
            assert_eq!(id.get_version(), Some(uuid::Version::Random));
            assert_eq!(id.get_variant(), uuid::Variant::RFC4122);
        }
        let other = Ids::new();
        assert_ne!(Ids::new().next(), other.next());
    }
}
