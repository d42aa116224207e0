//! The handlers of `POST /v1/completions`, `POST /v1/chat/completions` and `POST /generate`: start the request's
//! flow, then answer with D's status and relay its body (whole, or streamed while P is still
//! watched). The layers in front have given the request its id and its tracker and checked its
//! key.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::Response;
use std::time::Instant;

use crate::error::FailedUpstream;
use crate::flow::{self, Started};
use crate::layers::request_id::RequestId;
use crate::layers::track::TrackerSlot;
use crate::metrics::{CallOutcome, Outcome};
use crate::relay::{detach, Relay, Tracker};
use crate::route::Route;
use crate::state::AppState;
use pd_router::routing::decision::X_PD_ROUTE;
use pd_router::tenants::Tenant;
use std::sync::Arc;

use crate::rate_limits;

/// `POST /v1/completions`, `POST /v1/chat/completions` and `POST /generate`: the route is the
/// request's path. The request is taken whole, so its headers are read where they are.
pub(crate) async fn proxied(State(state): State<AppState>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let route = Route::at(parts.uri.path()).unwrap_or(Route::Completions);
    let request_id = match parts.extensions.get::<RequestId>() {
        Some(RequestId(id)) => id.clone(),
        // The layers in front always set it; without them the handler makes its own.
        None => state.ids.request_id(&parts.headers),
    };
    let slot = parts.extensions.get::<TrackerSlot>();
    let tenant = parts.extensions.get::<Arc<Tenant>>();
    serve(
        &state,
        route,
        request_id,
        slot,
        tenant,
        &parts.headers,
        body,
    )
    .await
}

async fn serve(
    state: &AppState,
    route: Route,
    request_id: HeaderValue,
    slot: Option<&TrackerSlot>,
    tenant: Option<&Arc<Tenant>>,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    let mut tracker = slot
        .and_then(TrackerSlot::take)
        .unwrap_or_else(|| Tracker::new(state.route_metrics(route).clone(), Instant::now()));
    let start = tracker.started();
    match flow::start(
        state,
        route,
        headers,
        &request_id,
        tenant,
        body,
        &mut tracker,
    )
    .await
    {
        Ok(started) => respond(started, tracker, start),
        Err(refusal) => {
            tracker.finish(refusal.outcome);
            let mut response = *refusal.response;
            name_failed_upstream(state, headers, &request_id, &mut response);
            response
        }
    }
}

/// Which engine failed the request: logged, and told in `x-pd-upstream` to operators (a
/// request with the admin key, as its bearer token or, where a tenant's key is the bearer
/// token, in `x-pd-admin-key`; or any request of a proxy without keys); the body never says.
fn name_failed_upstream(
    state: &AppState,
    headers: &HeaderMap,
    request_id: &HeaderValue,
    response: &mut Response,
) {
    let Some(FailedUpstream(who)) = response.extensions_mut().remove::<FailedUpstream>() else {
        return;
    };
    tracing::warn!(request_id = ?request_id, upstream = %who, status = %response.status(), "an engine failed the request");
    let operator = match &state.admin_key {
        Some(key) => {
            key.admits(headers)
                || (headers.get(X_PD_ADMIN_KEY)).is_some_and(|value| key.matches(value.as_bytes()))
        }
        None => state.tenants.is_none(),
    };
    if operator {
        if let Ok(value) = HeaderValue::from_str(&who) {
            response.headers_mut().insert(X_PD_UPSTREAM, value);
        }
    }
}

/// The header naming the engine that failed a request, for operators.
pub(crate) const X_PD_UPSTREAM: &str = "x-pd-upstream";

/// The header an operator's request sends the admin key in when its bearer token is a
/// tenant's key (never sent on to the engines).
const X_PD_ADMIN_KEY: &str = "x-pd-admin-key";

/// D's status and content type, and its body: whole when it is all in (the usual non-streamed
/// case), else relayed as it comes.
fn respond(started: Started, mut tracker: Tracker, start: Instant) -> Response {
    let Started {
        decode,
        decode_call,
        prefill,
        overhead,
        route,
        watch,
        resume,
        rate,
    } = started;
    let first_at = decode.first_at;
    tracker.metrics().first_byte(first_at.duration_since(start));
    if let Some(trace) = tracker.trace_mut() {
        trace.relaying();
    }
    let status = decode.status;
    let content_type = decode.content_type.clone();
    let sse = content_type
        .as_ref()
        .is_some_and(|value| value.as_bytes().starts_with(b"text/event-stream"));
    let metrics = tracker.metrics().clone();
    let mut watch = watch.filter(|_| sse);
    if let (Some(watch), Some(first)) = (&mut watch, &decode.first) {
        watch.chunk_at(first, first_at);
    }
    let body = if decode.complete {
        if let Some(watch) = watch {
            watch.ended();
        }
        decode_call.finish(CallOutcome::Ok);
        if let Some(prefill) = prefill {
            detach(prefill);
        }
        tracker.finish(Outcome::Ok);
        Body::from(decode.first.unwrap_or_default())
    } else {
        let relay = Relay::new(decode, decode_call, prefill, sse, tracker);
        Body::from_stream(relay.watched(watch).resumable(resume))
    };
    let mut response = Response::new(body);
    *response.status_mut() = status;
    if let Some(content_type) = content_type {
        response.headers_mut().insert(CONTENT_TYPE, content_type);
    }
    if let Some(route) = route {
        response.headers_mut().insert(X_PD_ROUTE.clone(), route);
    }
    if let Some(rate) = rate {
        rate_limits::insert_status(response.headers_mut(), &rate);
    }
    metrics.overhead(overhead + first_at.elapsed());
    response
}
