//! The HTTP side, on `--metrics-port`: `GET /metrics` (Prometheus), `GET /health` (the process
//! answers), `GET /ready` (a request can be placed, and pd-epp is not on its way out) and, with
//! `--admin-key`, `POST /admin/drain` (`{"url": ENGINE_URL, "draining": true|false}`: no new
//! request is placed on that engine; those in flight finish), the same as pd-proxy's.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Json;
use http::HeaderMap;
use pd_service::Draining;
use serde_json::{json, Value};

use crate::service::Shared;

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
        .route("/admin/drain", post(drain))
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

/// An error of the admin route, in OpenAI's shape.
fn admin_error(status: StatusCode, message: &str) -> (StatusCode, Json<Value>) {
    let body = json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": status.as_u16()}});
    (status, Json(body))
}

async fn drain(
    State(http): State<Http>,
    headers: HeaderMap,
    body: Result<Json<Value>, axum::extract::rejection::JsonRejection>,
) -> Result<Json<Value>, (StatusCode, Json<Value>)> {
    let Some(key) = &http.shared.admin_key else {
        let message = "the admin route is off: start pd-epp with --admin-key to drain engines";
        return Err(admin_error(StatusCode::FORBIDDEN, message));
    };
    if !key.admits(&headers) {
        let message = "draining needs the header Authorization: Bearer <key> with --admin-key";
        return Err(admin_error(StatusCode::UNAUTHORIZED, message));
    }
    let Json(body) = body.map_err(|err| admin_error(StatusCode::BAD_REQUEST, &err.body_text()))?;
    let Some(url) = body.get("url").and_then(Value::as_str) else {
        return Err(admin_error(
            StatusCode::BAD_REQUEST,
            "`url`: the engine's URL is required",
        ));
    };
    let draining = match body.get("draining") {
        None => true,
        Some(Value::Bool(draining)) => *draining,
        Some(_) => {
            return Err(admin_error(
                StatusCode::BAD_REQUEST,
                "`draining`: expected true or false",
            ));
        }
    };
    let url = url.trim_end_matches('/');
    let backends = http.shared.router.pool().backends();
    let backend = backends
        .iter()
        .find(|backend| backend.url() == url)
        .ok_or_else(|| {
            admin_error(
                StatusCode::NOT_FOUND,
                &format!("`url`: no engine {url:?} is configured"),
            )
        })?;
    backend.set_drained(draining);
    Ok(Json(json!({
        "url": backend.url(),
        "role": backend.role().as_str(),
        "draining": backend.is_drained(),
        "in_flight": backend.outstanding(),
    })))
}
