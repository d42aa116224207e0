//! The per-request flow of the proxied routes, from the client's body to D's answer beginning,
//! in three named stages:
//!
//! 1. [`intake`]: the body read under the client limits and parsed (top level only); its model
//!    found and its alias resolved (`pd_router::models`); its class read from its headers
//!    (priority, tenant, latency targets);
//! 2. [`placement`]: the prompt tokenized where a policy needs it, the request admitted
//!    (`pd_router::admission`: at once while the pool has room, else after waiting its turn,
//!    else 429; not in `--sidecar` mode, where the gateway's picker admits), the router's placement
//!    (a (prefill, dp rank) pair and a decode, or a decode alone), its decision counted, traced
//!    and told in `x-pd-route` when asked;
//! 3. [`dispatch`]: P and D called as `--mode` says (one file per mode), D retried once
//!    elsewhere; a decode that fails after its prefill answered is placed again with a fresh
//!    prefill ([`migration`]).
//!
//! The fourth stage, relaying D's answer, is [`crate::relay`]'s; a streamed answer that can be
//! continued exactly is followed there and continued on another decode should its decode fail
//! mid-answer ([`migration`] makes the continuation). Every call ends by the request's
//! deadline (`--request-timeout` from its arrival). Every future is owned by the request, so a
//! client that goes away cancels both calls.

mod dispatch;
mod failure;
mod intake;
mod migration;
mod placement;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use bytes::Bytes;
use pd_router::admission::RequestClass;
use pd_router::backend::Backend;
use pd_router::body::Body;
use pd_router::models;
use pd_router::tenants::{RateStatus, Tenant};
use pd_router::validate;

pub(crate) use failure::Refusal;

use crate::error::ApiError;
use crate::metrics::{Outcome, RouteMetrics};
use crate::models::ModelHandles;
use crate::rate_limits;
use crate::relay::{PrefillCall, Resumption, Tracker};
use crate::route::Route;
use crate::state::AppState;
use crate::trace::RequestTrace;
use crate::upstream::DecodeStart;

/// D answered; its body can be relayed.
pub(crate) struct Started {
    /// D's answer so far.
    pub decode: DecodeStart,
    /// D's call, to be finished when its answer ends.
    pub decode_call: pd_router::backend::Call,
    /// P's call, when it is still running.
    pub prefill: Option<PrefillCall>,
    /// The proxy's own time before D's call was issued.
    pub overhead: Duration,
    /// The routing decision, for the answer's `x-pd-route` header (when the client asked).
    pub route: Option<HeaderValue>,
    /// The answer's latencies watched, to teach the engines' models (streamed answers on the
    /// decode placed).
    pub watch: Option<pd_router::placement::Watch>,
    /// How the answer goes on elsewhere should its decode fail mid-answer (streamed answers
    /// whose continuation is exact).
    pub resume: Option<Resumption>,
    /// Where the request's tenant stands against its limits, for the `x-ratelimit-*` headers
    /// (tenants with limits).
    pub rate: Option<RateStatus>,
}

impl Started {
    /// The same start, its tenant standing at `rate`.
    fn rated(self, rate: Option<RateStatus>) -> Self {
        Started { rate, ..self }
    }
}

/// What every stage knows of the request.
struct Request<'a> {
    state: &'a AppState,
    route: Route,
    headers: &'a HeaderMap,
    request_id: &'a HeaderValue,
    /// The model asked for (after aliases), if any.
    model: Option<&'a str>,
    /// The route's metrics for that model.
    metrics: Arc<RouteMetrics>,
    /// When it arrived.
    start: Instant,
    /// When the whole request must be over.
    deadline: Instant,
    /// Its priority, tenant and latency targets.
    class: &'a RequestClass,
    /// Decodes it must not go to (they failed it).
    avoid: &'a [Arc<Backend>],
    /// Whether it continues a request already admitted (a migration).
    continued: bool,
}

/// Runs the stages: returns once D's answer has begun (or the request failed).
pub(crate) async fn start(
    state: &AppState,
    route: Route,
    headers: &HeaderMap,
    request_id: &HeaderValue,
    tenant: Option<&Arc<Tenant>>,
    body: axum::body::Body,
    tracker: &mut Tracker,
) -> Result<Started, Refusal> {
    let start = tracker.started();
    let arrived = intake::read(state, body).await?;
    // The parsed body borrows from these bytes.
    let parsed = intake::parse(&arrived)?;
    let asked = models::requested(&parsed, route == Route::Generate);
    let model = asked.as_deref().map(|m| state.router.models().canonical(m));
    let aliased = models::aliased(&parsed, asked.as_deref(), model);
    let bytes = aliased.as_ref().unwrap_or(&arrived);
    let mut body = match &aliased {
        Some(rewritten) => intake::parse(rewritten)?,
        None => parsed,
    };
    let handles = state.model_metrics(model);
    let metrics = handles.route(route).clone();
    // A refusal below is counted under the model asked for.
    tracker.retarget(metrics.clone());
    let context = || state.pool().context_length(model);
    validate::check(&body, rate_limits::api(route), context).map_err(|invalid| {
        Refusal::from((
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                invalid.message,
            )
            .with_param(invalid.param),
            Outcome::BadRequest,
        ))
    })?;
    let followed = migration::follow(state, route, &mut body);
    let mut class = (state.router.classify(headers)).map_err(|err| failure::bad_class(&err))?;
    let rate = match tenant {
        Some(tenant) => {
            // The key's tenant is the request's fair share, whatever its headers say.
            class.tenant = tenant.name().clone();
            intake::charge(state, tenant, route, &body)?
        }
        None => None,
    };
    let deadline = start + state.upstream.request_timeout;
    let request = Request {
        state,
        route,
        headers,
        request_id,
        model,
        metrics,
        start,
        deadline,
        class: &class,
        avoid: &[],
        continued: false,
    };
    let trace = tracker.trace();
    let (started, failed) = placed_and_called(&request, bytes, &body, &handles, trace).await?;
    Ok(match followed {
        Some(asked) => {
            let resumption =
                migration::Migrator::resumption(&request, bytes.clone(), asked, failed);
            Started {
                resume: Some(resumption),
                ..started
            }
        }
        None => started,
    }
    .rated(rate))
}

/// Places the request and calls its engines; should its decode fail after its prefill
/// answered, places it again with a fresh prefill (within the migration limit). Returns the
/// decodes that failed it too.
async fn placed_and_called(
    request: &Request<'_>,
    raw: &Bytes,
    body: &Body<'_>,
    handles: &ModelHandles,
    trace: Option<&RequestTrace>,
) -> Result<(Started, Vec<Arc<Backend>>), Refusal> {
    let placed = placement::place(request, raw, body, handles, trace).await?;
    match dispatch::run(request, body, placed, trace).await {
        Ok(started) => Ok((started, request.avoid.to_vec())),
        Err(refusal) if refusal.replaceable.is_some() => {
            migration::replace(request, raw, body, handles, trace, refusal).await
        }
        Err(refusal) => Err(refusal),
    }
}
