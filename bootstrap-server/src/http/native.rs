//! pd-bootstrap's own routes: leases, deregistration, request release, the worker list and its
//! changes (`GET /workers`, `GET /watch`), health, readiness (`GET /readyz`: this server takes
//! traffic; `GET /ready`: the configured topology is complete) and metrics.

use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use pd_protocol::native::{
    Deregister, DeregisterResponse, DrainResponse, LeaseStatus, ReadyStatus, ReleaseResponse,
    RevokeResponse, WatchBatch, WatchGone, WorkerEvent, WorkerEventKind, WorkerInfo, WorkerList,
};
use pd_protocol::{LeaseId, Revision, Status};
use serde::Deserialize;

use super::error::ApiError;
use super::extract::JsonBody;
use super::{rejected, vllm, AppState};
use crate::registry::model::{Change, ChangeKind, Deregistration, WorkerRecord};
use crate::registry::Changes;
use crate::registry::RegistryError;

/// How long `GET /watch` waits for a change when the caller does not say.
const WATCH_WAIT_DEFAULT_MS: u64 = 20_000;

/// The longest `GET /watch` waits (longer asks are shortened): five sixths of the request
/// timeout (25 s at the default 30 s), and 25 s at most.
const WATCH_WAIT_MAX: Duration = Duration::from_secs(25);

/// The write routes (behind the bearer token when one is set).
pub fn writes() -> Router<AppState> {
    Router::new()
        .route("/register", axum::routing::delete(deregister))
        .route("/requests/{req_id}", delete(release_request))
        .route("/leases/{lease_id}", delete(revoke_lease))
        .route("/leases/{lease_id}/keepalive", post(keep_alive))
        .route("/engines/{engine_id}/drain", post(drain).delete(undrain))
}

/// The read routes.
pub fn reads() -> Router<AppState> {
    Router::new()
        .route("/workers", get(workers))
        .route("/watch", get(watch))
        .merge(probes())
}

/// Liveness and readiness (`/health` also says why writes are open, when they are).
pub fn probes() -> Router<AppState> {
    Router::new()
        .route("/health", get(health))
        .route("/readyz", get(readyz))
        .route("/ready", get(ready))
}

/// The registry's metrics, an operator's route.
pub fn metrics_route() -> Router<AppState> {
    Router::new().route("/metrics", get(metrics))
}

/// The wire form of a registered worker.
pub fn worker_info(record: &WorkerRecord) -> WorkerInfo {
    WorkerInfo {
        engine_id: record.engine_id.as_deref().map(str::to_owned),
        dp_rank: record.slot.dp,
        tp_rank: record.slot.tp,
        pp_rank: record.slot.pp,
        addr: record.addr.clone(),
        lease_id: record.lease.map(|l| l.id),
        lease_id_str: record.lease.map(|l| l.id.to_string()),
        incarnation: Some(record.incarnation),
        draining: record.draining,
        meta: (*record.meta).clone(),
    }
}

fn worker_event(change: &Change) -> WorkerEvent {
    WorkerEvent {
        revision: change.revision,
        kind: match change.kind {
            ChangeKind::Put => WorkerEventKind::Put,
            ChangeKind::Delete => WorkerEventKind::Delete,
        },
        worker: worker_info(&change.worker),
    }
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
        lease_id_str: lease_id.to_string(),
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

async fn deregister(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<Deregister>,
) -> Result<Json<DeregisterResponse>, ApiError> {
    let selection = Deregistration {
        engine_id: body.engine_id,
        dp: body.dp_rank,
        tp: body.tp_rank,
        pp: body.pp_rank,
    };
    let removed = state.registry.deregister(&selection).await?;
    Ok(Json(DeregisterResponse {
        status: "ok".to_owned(),
        removed,
    }))
}

/// `POST /engines/{engine_id}/drain`: routers stop sending the engine new requests.
async fn drain(
    State(state): State<AppState>,
    Path(engine_id): Path<String>,
) -> Result<Json<DrainResponse>, ApiError> {
    mark(&state, engine_id, true).await
}

/// `DELETE /engines/{engine_id}/drain`: the engine takes requests again.
async fn undrain(
    State(state): State<AppState>,
    Path(engine_id): Path<String>,
) -> Result<Json<DrainResponse>, ApiError> {
    mark(&state, engine_id, false).await
}

async fn mark(
    state: &AppState,
    engine_id: String,
    draining: bool,
) -> Result<Json<DrainResponse>, ApiError> {
    let workers = state.registry.drain(&engine_id, draining).await?;
    Ok(Json(DrainResponse {
        status: "ok".to_owned(),
        engine_id,
        draining,
        workers,
    }))
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

async fn workers(State(state): State<AppState>) -> Json<WorkerList> {
    let (revision, workers) = state.registry.list();
    Json(WorkerList {
        revision,
        workers: workers.iter().map(worker_info).collect(),
    })
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
    // A long poll must answer before the request timeout turns it into a 408.
    let longest = WATCH_WAIT_MAX.min(state.request_timeout / 6 * 5);
    let asked = Duration::from_millis(params.timeout_ms.unwrap_or(WATCH_WAIT_DEFAULT_MS));
    let watched = tokio::select! {
        watched = state.registry.watch(params.since, asked.min(longest)) => watched,
        // A server that stops accepting does not wait out its long polls: nothing new, so far.
        () = state.draining.stopping() => Ok(Changes {
            revision: params.since,
            changes: Vec::new(),
        }),
    };
    match watched {
        Ok(changes) => Ok(Json(WatchBatch {
            revision: changes.revision,
            events: changes.changes.iter().map(worker_event).collect(),
        })
        .into_response()),
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

/// `GET /health`: `{"status": "ok"}`, with a `warning` while writes are open to anyone.
async fn health(State(state): State<AppState>) -> Response {
    match &state.open_writes {
        None => Json(Status::ok()).into_response(),
        Some(warning) => {
            Json(serde_json::json!({"status": "ok", "warning": &**warning})).into_response()
        }
    }
}

/// `GET /readyz`: whether this server takes traffic, for a Kubernetes readinessProbe:
/// `{"status": "ready"}`, or 503 with `"status": "not_ready"` and why once it is shutting down.
/// Unlike `/ready` it does not wait for the topology: P's workers register through the same
/// address.
async fn readyz(State(state): State<AppState>) -> Response {
    match state.draining.not_ready_reason() {
        None => Json(Status {
            status: "ready".to_owned(),
        })
        .into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "not_ready", "detail": reason})),
        )
            .into_response(),
    }
}

/// `GET /ready`: the configured topology is complete (503 with the counts until it is, and
/// while the server is shutting down).
async fn ready(State(state): State<AppState>) -> Response {
    let readiness = state.registry.readiness();
    let mut body = ReadyStatus {
        status: "ready".to_owned(),
        registered: readiness.registered,
        expected: readiness.expected,
        missing: readiness.missing,
        detail: None,
    };
    let detail = match state.draining.not_ready_reason() {
        Some(reason) => Some(reason.to_owned()),
        None => readiness
            .is_incomplete()
            .then(|| vllm::not_ready(readiness)),
    };
    if detail.is_some() {
        body.status = "not_ready".to_owned();
        body.detail = detail;
        return (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    }
    Json(body).into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    let text = state.metrics.render(state.registry.stats());
    ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], text).into_response()
}
