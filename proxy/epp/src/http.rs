//! The HTTP side, on `--metrics-port`: `GET /metrics` (Prometheus), `GET /health` (the process
//! answers), `GET /ready` (a request can be placed, and pd-epp is not on its way out) and, with
//! `--admin-key`, pd-proxy's operator routes: `GET /admin/backends` and `POST /admin/drain`
//! (`{"url": ENGINE_URL, "draining": true|false}`: no new request is placed on that engine;
//! those running finish), so `worker-client drain --backend URL --wait-idle EPP_URL` drains
//! an engine at pd-epp as at a pd-proxy; and `POST /admin/duties` (engines of both roles,
//! `--dual`: `{"duties": {ENGINE_URL: "prefill"|"decode"}}`).

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Json;
use http::HeaderMap;
use pd_protocol::proxy_admin::{BackendState, Backends, DrainRequest};
use pd_router::backend::states::{find, state_of, states};
use pd_router::duty::DutiesRequest;
use pd_service::Draining;
use serde_json::{json, Value};

use crate::state::Shared;

/// What the handlers read.
#[derive(Clone)]
struct Http {
    shared: Arc<Shared>,
    draining: Draining,
}

/// The routes.
pub(crate) fn router(shared: Arc<Shared>, draining: Draining) -> axum::Router {
    axum::Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/admin/backends", get(backends))
        .route("/admin/drain", post(drain))
        .route("/admin/duties", post(duties))
        .with_state(Http { shared, draining })
}

async fn metrics(State(http): State<Http>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        http.shared.metrics.render(),
    )
}

async fn ready(State(http): State<Http>) -> impl IntoResponse {
    if let Some(reason) = http.draining.not_ready_reason() {
        return (StatusCode::SERVICE_UNAVAILABLE, reason);
    }
    match http.shared.is_ready() {
        true => (StatusCode::OK, "ready"),
        false => (
            StatusCode::SERVICE_UNAVAILABLE,
            "no request can be placed: no decode (or no prefill) is ready",
        ),
    }
}

/// An error of the admin routes, in OpenAI's shape.
fn admin_error(status: StatusCode, message: &str) -> (StatusCode, Json<Value>) {
    let body = json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": null}});
    (status, Json(body))
}

/// Whether `headers` carry the admin key.
fn admitted(http: &Http, headers: &HeaderMap) -> Result<(), (StatusCode, Json<Value>)> {
    let Some(key) = &http.shared.admin_key else {
        let message = "the admin routes are off: start pd-epp with --admin-key";
        return Err(admin_error(StatusCode::FORBIDDEN, message));
    };
    match key.admits(headers) {
        true => Ok(()),
        false => Err(admin_error(
            StatusCode::UNAUTHORIZED,
            "the admin routes need the header Authorization: Bearer <key> with --admin-key",
        )),
    }
}

/// `GET /admin/backends`: every engine, its health, drain marks and the requests pd-epp
/// placed on it still running (what `worker-client drain --wait-idle` reads).
async fn backends(
    State(http): State<Http>,
    headers: HeaderMap,
) -> Result<Json<Backends>, (StatusCode, Json<Value>)> {
    admitted(&http, &headers)?;
    let (prefills, decodes) = states(http.shared.router.pool(), |_, backend| backend);
    Ok(Json(Backends { prefills, decodes }))
}

/// `POST /admin/drain`: no new request is placed on the engine (those running finish), or
/// the mark is lifted; answers the engine's state.
async fn drain(
    State(http): State<Http>,
    headers: HeaderMap,
    body: Result<Json<DrainRequest>, JsonRejection>,
) -> Result<Json<BackendState>, (StatusCode, Json<Value>)> {
    admitted(&http, &headers)?;
    let Json(request) =
        body.map_err(|err| admin_error(StatusCode::BAD_REQUEST, &err.body_text()))?;
    let backend = find(http.shared.router.pool(), &request.url).ok_or_else(|| {
        let message = format!("`url`: no engine {:?} is configured", request.url);
        admin_error(StatusCode::NOT_FOUND, &message)
    })?;
    backend.set_drained(request.draining);
    Ok(Json(state_of(&backend, Vec::new(), false)))
}

/// `POST /admin/duties`: puts engines of both roles (`--dual`) on the duties named, all at
/// once, once their new directions are warmed up; answers every dual's duty.
async fn duties(
    State(http): State<Http>,
    headers: HeaderMap,
    body: Result<Json<DutiesRequest>, JsonRejection>,
) -> Result<Json<Value>, (StatusCode, Json<Value>)> {
    admitted(&http, &headers)?;
    let Json(request) =
        body.map_err(|err| admin_error(StatusCode::BAD_REQUEST, &err.body_text()))?;
    let Some(duties) = http.shared.router.duties() else {
        let message = "no engine of both roles: start pd-epp with --dual URL BOOTSTRAP_PORT";
        return Err(admin_error(StatusCode::NOT_FOUND, message));
    };
    let duals = (duties.assign(&request.duties).await)
        .map_err(|err| admin_error(err.status(), &err.to_string()))?;
    Ok(Json(json!({ "duals": duals })))
}
