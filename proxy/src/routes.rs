//! The routes: the proxied `/v1` ones behind their layers, the probes (`/health`, `/ready`) and
//! the operator's (`/metrics`, `/admin/*`, the live pages), with JSON 404 and 405 for anything
//! else. The operator's are on the serving port behind the admin key once any key is set
//! ([`RequireOperator`]), or on a listener of their own (`--admin-port`, [`admin_router`]).

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tower::ServiceBuilder;

use crate::error::ApiError;
use crate::layers::auth::Authenticate;
use crate::layers::operator::RequireOperator;
use crate::layers::request_id::AssignRequestIdLayer;
use crate::layers::track::TrackLayer;
use crate::readiness::readiness;
use crate::state::AppState;
use crate::{admin, handler, model_list, ui};

/// The serving port's router: the proxied routes behind their layers (see [`crate::layers`]),
/// the probes, and (without `--admin-port`) the operator's routes.
pub(crate) fn router(state: AppState) -> Router {
    let serving = clients(&state).merge(probes());
    let serving = match state.admin_listener {
        true => serving,
        false => serving.merge(operator()),
    };
    finished(serving, &state).layer(RequireOperator::layer(&state))
}

/// The `--admin-port` listener's router: the operator's routes and the probes, no key asked
/// beyond the admin routes' own.
pub(crate) fn admin_router(state: AppState) -> Router {
    finished(operator().merge(probes()), &state)
}

/// The routes with the fallbacks' JSON errors and the state.
fn finished(routes: Router<AppState>, state: &AppState) -> Router {
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state.clone())
}

/// The clients' routes, behind their layers.
fn clients(state: &AppState) -> Router<AppState> {
    let completions = Router::new()
        .route("/v1/completions", post(handler::proxied))
        .route("/v1/chat/completions", post(handler::proxied))
        .route("/generate", post(handler::proxied))
        // One stack, outermost first, of concrete futures: no layer boxes what it wraps.
        .route_layer(
            ServiceBuilder::new()
                .layer(AssignRequestIdLayer(state.clone()))
                .layer(TrackLayer(state.clone()))
                .layer(Authenticate::layer(state)),
        );
    let models = Router::new()
        .route("/v1/models", get(model_list::models))
        .route_layer(Authenticate::layer(state));
    completions.merge(models)
}

/// The probes: open everywhere.
fn probes() -> Router<AppState> {
    Router::new()
        .route("/health", get(health_route))
        .route("/ready", get(ready))
}

/// The operator's routes: the metrics, the admin routes, the live pages.
fn operator() -> Router<AppState> {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/admin/backends", get(admin::backends))
        .route("/admin/drain", post(admin::drain))
        .route("/admin/duties", post(admin::duties))
        .route("/admin/kv-index", get(admin::kv_index))
        .route("/admin/kv-index/match", post(admin::kv_match))
        .merge(ui::routes())
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
