//! The HTTP API: one module per wire dialect ([`vllm`], [`sglang`], [`native`]) that maps its JSON to
//! registry calls and renders answers and errors in its clients' words, the operator's routes
//! (`/metrics`, the live page), and the layers every route shares (the write guard, timeouts,
//! metrics, JSON errors, body limit).
//!
//! The operator's routes are served on the workers' port, behind the write guard once writes
//! are protected (`/metrics` may stay open to scrapers), or on a listener of their own
//! ([`admin_router`]), the workers' port then answering them 404.

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

/// Where the operator's routes (`/metrics`, `/ui*`) are served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperatorRoutes {
    /// On the workers' port, behind the write guard when writes are protected; `/metrics` open
    /// to anyone when `metrics_open`.
    Guarded {
        /// Whether `/metrics` needs nothing.
        metrics_open: bool,
    },
    /// On a listener of their own ([`admin_router`]): not on the workers' port.
    Elsewhere,
}

/// Builds the workers' router; every write route goes through `guard` (see [`WriteGuard`]),
/// the operator's routes as `operator` says, and a request whose body or answer takes longer
/// than the state's `request_timeout` is answered with a 408.
pub fn router(state: AppState, guard: WriteGuard, operator: OperatorRoutes) -> Router {
    let routes = vllm::writes()
        .merge(sglang::writes())
        .merge(native::writes())
        .route_layer(GateLayer(guard.clone()))
        .merge(vllm::reads())
        .merge(sglang::reads())
        .merge(native::reads());
    let routes = match operator {
        OperatorRoutes::Elsewhere => routes,
        OperatorRoutes::Guarded { metrics_open } => {
            let metrics = match metrics_open {
                true => native::metrics_route(),
                false => native::metrics_route().route_layer(GateLayer(guard.clone())),
            };
            routes
                .merge(ui::routes().route_layer(GateLayer(guard)))
                .merge(metrics)
        }
    };
    finish(routes, state)
}

/// The router of the operator's own listener (`--admin-port`): `/metrics`, the live page and
/// the probes, open to whoever reaches that address.
pub fn admin_router(state: AppState) -> Router {
    let routes = native::metrics_route()
        .merge(ui::routes())
        .merge(native::probes());
    finish(routes, state)
}

/// `routes` with the JSON 404, the layers every route shares, and `state`.
fn finish(routes: Router<AppState>, state: AppState) -> Router {
    let request_timeout = state.request_timeout;
    routes
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
