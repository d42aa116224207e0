//! The HTTP API: one module per wire dialect ([`vllm`], [`sglang`], [`native`]) that maps its JSON to
//! registry calls and renders answers and errors in its clients' words, and the layers every
//! route shares (bearer token on writes, timeouts, metrics, JSON errors, body limit).

mod auth;
mod error;
mod extract;
mod json_errors;
pub mod native;
pub mod sglang;
mod track;
mod ui;
pub mod vllm;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::Router;
use pd_service::{Draining, GateLayer};
use tower::ServiceBuilder;
use tower_http::timeout::{RequestBodyTimeoutLayer, TimeoutLayer};

pub use auth::WriteGuard;
pub use error::{wire_error_body, ApiError};

use crate::metrics::Metrics;
use crate::registry::Registry;

/// The largest request body accepted (413 above it).
pub const MAX_BODY_BYTES: usize = 1024 * 1024;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    /// The registry.
    pub registry: Arc<Registry>,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// Why writes are unprotected, when they are (shown by `GET /health`).
    pub open_writes: Option<Arc<str>>,
    /// How long a request may take before it is answered with a 408 (long polls end sooner).
    pub request_timeout: Duration,
    /// Whether the server is on its way out (`/readyz` and `/ready` then answer 503, and long
    /// polls end when it stops accepting).
    pub draining: Draining,
}

/// Builds the full router; every write route goes through `guard` (see [`WriteGuard`]), and a
/// request whose body or answer takes longer than the state's `request_timeout` is answered
/// with a 408.
pub fn router(state: AppState, guard: WriteGuard) -> Router {
    let request_timeout = state.request_timeout;
    vllm::writes()
        .merge(sglang::writes())
        .merge(native::writes())
        .route_layer(GateLayer(guard))
        .merge(vllm::reads())
        .merge(sglang::reads())
        .merge(native::reads())
        .merge(ui::routes())
        .fallback(not_found)
        // One layer, so one boxed service per route: each `Router::layer` call boxes every route
        // once more, and a request cloned every box of its route, each middleware cloning its
        // inner ones again (a quarter of a `GET /query`'s instructions).
        .layer(
            // Outer to inner: the timeouts answer 408s that the metrics and JSON layers see.
            ServiceBuilder::new()
                .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
                .layer(json_errors::JsonErrorsLayer)
                .layer(track::TrackLayer(state.metrics.clone()))
                .layer(RequestBodyTimeoutLayer::new(request_timeout))
                .layer(TimeoutLayer::with_status_code(
                    StatusCode::REQUEST_TIMEOUT,
                    request_timeout,
                )),
        )
        .with_state(state)
}

async fn not_found(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no route for {} {}", request.method(), request.uri().path()),
    )
}

/// A query-string or path rejection as a JSON error naming what was wrong.
pub(crate) fn rejected(rejection: impl IntoResponse + std::fmt::Display) -> ApiError {
    let text = rejection.to_string();
    ApiError::new(rejection.into_response().status(), text)
}
