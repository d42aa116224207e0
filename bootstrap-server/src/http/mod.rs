//! The HTTP API: routes, handlers and the layers around them.

mod auth;
mod error;
mod extract;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use bytes::Bytes;
use pd_protocol::native::{
    Deregister, DeregisterResponse, LeaseStatus, ReadyStatus, ReleaseResponse, RevokeResponse,
    WatchBatch, WatchGone, WorkerList,
};
use pd_protocol::vllm::{
    QueryRequests, RegisterLegacyWorker, RegisterRequest, RegisterResponse, RegisterWorker,
    RequestLocation,
};
use pd_protocol::{LeaseId, Revision, Status};
use pd_service::BearerToken;
use serde::Deserialize;
use tower_http::timeout::{RequestBodyTimeoutLayer, TimeoutLayer};

pub use error::ApiError;
use extract::JsonBody;

use crate::metrics::Metrics;
use crate::registry::{Registry, RegistryError};

/// The largest request body accepted (413 above it).
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// The longest a request may take, body included, before it is answered with a timeout.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// How long `GET /watch` waits for a change when the caller does not say.
const WATCH_WAIT_DEFAULT_MS: u64 = 20_000;

/// The longest `GET /watch` waits (longer asks are shortened), well inside `REQUEST_TIMEOUT`.
const WATCH_WAIT_MAX_MS: u64 = 25_000;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    /// The registry.
    pub registry: Arc<Registry>,
    /// The metrics.
    pub metrics: Arc<Metrics>,
}

/// Builds the full router. With `auth`, every write route requires that bearer token.
pub fn router(state: AppState, auth: Option<BearerToken>) -> Router {
    let mut writes = Router::new()
        .route("/register", post(register).delete(deregister))
        .route("/register_worker", post(register_worker))
        .route("/register_request", post(register_request))
        .route("/requests/{req_id}", delete(release_request))
        .route("/leases/{lease_id}", delete(revoke_lease))
        .route("/leases/{lease_id}/keepalive", post(keep_alive));
    if let Some(token) = auth {
        writes = writes.route_layer(middleware::from_fn_with_state(token, auth::require_token));
    }
    let reads = Router::new()
        .route("/query", get(query))
        .route("/query_requests", post(query_requests))
        .route("/workers", get(workers))
        .route("/watch", get(watch))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics));
    writes
        .merge(reads)
        .fallback(not_found)
        // Inner to outer: the timeouts answer 408s that the JSON and metrics layers then see.
        .layer(TimeoutLayer::with_status_code(
            StatusCode::REQUEST_TIMEOUT,
            REQUEST_TIMEOUT,
        ))
        .layer(RequestBodyTimeoutLayer::new(REQUEST_TIMEOUT))
        .layer(middleware::from_fn_with_state(state.clone(), track))
        .layer(middleware::from_fn(error::json_errors))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Counts every request by route, method and status, and times it.
async fn track(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = request.extensions().get::<MatchedPath>().cloned();
    let method = request.method().clone();
    let response = next.run(request).await;
    state.metrics.observe_http(
        route.as_ref().map_or("unmatched", MatchedPath::as_str),
        method.as_str(),
        response.status().as_str(),
        started.elapsed(),
    );
    response
}

async fn not_found(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no route for {} {}", request.method(), request.uri().path()),
    )
}

fn json_bytes(body: Bytes) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

async fn register(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<RegisterWorker>,
) -> Result<Json<RegisterResponse>, ApiError> {
    Ok(Json(state.registry.register(&body).await?))
}

/// A query-string or path rejection as a JSON error naming what was wrong.
fn rejected(rejection: impl IntoResponse + std::fmt::Display) -> ApiError {
    let text = rejection.to_string();
    ApiError::new(rejection.into_response().status(), text)
}

async fn keep_alive(
    State(state): State<AppState>,
    lease_id: Result<Path<LeaseId>, axum::extract::rejection::PathRejection>,
) -> Result<Json<LeaseStatus>, ApiError> {
    let Path(lease_id) = lease_id.map_err(rejected)?;
    let lease_ttl = state.registry.keep_alive(lease_id).await?;
    Ok(Json(LeaseStatus {
        status: "ok".to_owned(),
        lease_id,
        lease_ttl,
    }))
}

async fn revoke_lease(
    State(state): State<AppState>,
    lease_id: Result<Path<LeaseId>, axum::extract::rejection::PathRejection>,
) -> Result<Json<RevokeResponse>, ApiError> {
    let Path(lease_id) = lease_id.map_err(rejected)?;
    let revoked = state.registry.revoke(lease_id).await?;
    Ok(Json(RevokeResponse {
        status: "ok".to_owned(),
        revoked,
    }))
}

async fn workers(State(state): State<AppState>) -> Json<WorkerList> {
    Json(state.registry.list())
}

/// `GET /watch` parameters.
#[derive(Deserialize)]
struct WatchParams {
    since: Revision,
    timeout_ms: Option<u64>,
}

async fn watch(
    State(state): State<AppState>,
    params: Result<Query<WatchParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(params) = params.map_err(rejected)?;
    let wait_ms = params
        .timeout_ms
        .unwrap_or(WATCH_WAIT_DEFAULT_MS)
        .min(WATCH_WAIT_MAX_MS);
    match state
        .registry
        .watch(params.since, Duration::from_millis(wait_ms))
        .await
    {
        Ok(batch) => Ok(Json::<WatchBatch>(batch).into_response()),
        Err(
            err @ (RegistryError::Compacted { revision, .. }
            | RegistryError::AheadOfRegistry { revision, .. }),
        ) => Ok((
            StatusCode::GONE,
            Json(WatchGone {
                detail: err.to_string(),
                revision,
            }),
        )
            .into_response()),
        Err(err) => Err(err.into()),
    }
}

async fn deregister(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<Deregister>,
) -> Result<Json<DeregisterResponse>, ApiError> {
    let removed = state.registry.deregister(&body).await?;
    Ok(Json(DeregisterResponse {
        status: "ok".to_owned(),
        removed,
    }))
}

async fn register_worker(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<RegisterLegacyWorker>,
) -> Result<Json<Status>, ApiError> {
    state.registry.register_legacy(&body).await?;
    Ok(Json(Status::ok()))
}

/// `GET /query` parameters.
#[derive(Deserialize)]
struct QueryParams {
    engine_id: Option<String>,
}

async fn query(
    State(state): State<AppState>,
    params: Result<Query<QueryParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(params) = params.map_err(rejected)?;
    let body = state.registry.query(params.engine_id.as_deref())?;
    Ok(json_bytes(body))
}

async fn register_request(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<RegisterRequest>,
) -> Result<Json<Status>, ApiError> {
    state.registry.register_request(&body).await?;
    Ok(Json(Status::ok()))
}

async fn query_requests(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<QueryRequests>,
) -> Result<Response, ApiError> {
    let answer = state.registry.query_requests(&body)?;
    let (mut ok, mut retry, mut error) = (0, 0, 0);
    for location in answer.results.values() {
        match location {
            RequestLocation::Ok(_) => ok += 1,
            RequestLocation::Retry => retry += 1,
            RequestLocation::Error(_) => error += 1,
        }
    }
    state.metrics.observe_lookups(ok, retry, error);
    Ok(Json(answer).into_response())
}

async fn release_request(
    State(state): State<AppState>,
    Path(req_id): Path<String>,
) -> Result<Json<ReleaseResponse>, ApiError> {
    let released = state.registry.release_request(&req_id).await?;
    Ok(Json(ReleaseResponse {
        status: "ok".to_owned(),
        released,
    }))
}

async fn health() -> Json<Status> {
    Json(Status::ok())
}

async fn ready(State(state): State<AppState>) -> Response {
    let readiness = state.registry.readiness();
    let mut body = ReadyStatus {
        status: "ready".to_owned(),
        registered: readiness.registered,
        expected: readiness.expected,
        missing: readiness.missing,
        detail: None,
    };
    match readiness.expected {
        Some(expected) if readiness.missing > 0 => {
            body.status = "not_ready".to_owned();
            body.detail = Some(
                RegistryError::NotReady {
                    missing: readiness.missing,
                    expected,
                }
                .to_string(),
            );
            (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
        }
        _ => Json(body).into_response(),
    }
}

async fn metrics(State(state): State<AppState>) -> Response {
    let text = state.metrics.render(state.registry.stats());
    ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], text).into_response()
}
