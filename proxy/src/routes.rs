//! The routes: the proxied `/v1` ones behind their layers, and `/health`, `/ready`, `/metrics`,
//! with JSON 404 and 405 for anything else.

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tower::ServiceBuilder;

use crate::error::ApiError;
use crate::layers::auth::RequireApiKey;
use crate::layers::request_id::AssignRequestIdLayer;
use crate::layers::track::TrackLayer;
use crate::readiness::readiness;
use crate::state::AppState;
use crate::{admin, handler, model_list, ui};

/// Builds the router: the proxied routes behind their layers (see [`crate::layers`]), the
/// operational ones open.
pub(crate) fn router(state: AppState) -> Router {
    let completions = Router::new()
        .route("/v1/completions", post(handler::proxied))
        .route("/v1/chat/completions", post(handler::proxied))
        .route("/generate", post(handler::proxied))
        // One stack, outermost first, of concrete futures: no layer boxes what it wraps.
        .route_layer(
            ServiceBuilder::new()
                .layer(AssignRequestIdLayer(state.clone()))
                .layer(TrackLayer(state.clone()))
                .layer(RequireApiKey::layer(&state)),
        );
    let models = Router::new()
        .route("/v1/models", get(model_list::models))
        .route_layer(RequireApiKey::layer(&state));
    completions
        .merge(models)
        .route("/health", get(health_route))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/admin/backends", get(admin::backends))
        .route("/admin/drain", post(admin::drain))
        .route("/admin/kv-index", get(admin::kv_index))
        .route("/admin/kv-index/match", post(admin::kv_match))
        .merge(ui::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn not_found(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        format!("no route for {} {}", request.method(), request.uri().path()),
    )
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        format!(
            "method {} is not allowed on {}",
            request.method(),
            request.uri().path()
        ),
    )
}

/// `GET /health`: the proxy itself is up.
async fn health_route() -> Json<pd_protocol::Status> {
    Json(pd_protocol::Status::ok())
}

/// `GET /ready`: whether a request would find a (prefill, dp rank) pair and a decode.
async fn ready(State(state): State<AppState>) -> Response {
    let body = readiness(&state);
    let status = if body.detail.is_none() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

/// `GET /metrics`: Prometheus text format.
async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}
