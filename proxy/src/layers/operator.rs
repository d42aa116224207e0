//! The operator's routes on the serving port: `/metrics`, `/admin/*`, the live pages, and
//! anything else that is neither a client's route nor a probe. When any key is configured and
//! they have no listener of their own (`--admin-port`), they need the admin key; `/metrics` is
//! left to scrapers with `--metrics-open`. Secure by default: a route added later is the
//! operator's unless it is named here as open.

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use pd_service::{BearerToken, Gate, GateLayer};

use crate::error::ApiError;
use crate::state::AppState;

/// The paths open to clients (behind `--api-key`) and to probes, on the serving port.
pub(crate) const OPEN_PATHS: [&str; 6] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/generate",
    "/v1/models",
    "/health",
    "/ready",
];

/// Lets a request through when its path is open, or it carries the admin key, or the operator's
/// routes need no key.
#[derive(Clone)]
pub(crate) struct RequireOperator {
    /// Whether the serving port checks the operator's routes at all.
    enabled: bool,
    admin_key: Option<BearerToken>,
    metrics_open: bool,
}

impl RequireOperator {
    /// The gate of `state`'s serving port: on when a key is configured and the operator's
    /// routes have no listener of their own.
    pub(crate) fn layer(state: &AppState) -> GateLayer<Self> {
        let keyed = state.tenants.is_some() || state.admin_key.is_some();
        GateLayer(RequireOperator {
            enabled: keyed && !state.admin_listener,
            admin_key: state.admin_key.clone(),
            metrics_open: state.metrics_open,
        })
    }
}

impl Gate for RequireOperator {
    fn refusal(&self, request: &mut Request) -> Option<Response> {
        if !self.enabled {
            return None;
        }
        let path = request.uri().path();
        if OPEN_PATHS.contains(&path) || (self.metrics_open && path == "/metrics") {
            return None;
        }
        let (status, kind, message) = match &self.admin_key {
            Some(key) if key.admits(request.headers()) => return None,
            Some(_) => (
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "the operator's routes need the header Authorization: Bearer <key> with the \
                 proxy's --admin-key (or a listener of their own: --admin-port)",
            ),
            None => (
                StatusCode::FORBIDDEN,
                "permission_error",
                "the operator's routes are closed on the serving port while a key is set: start \
                 pd-proxy with --admin-key, or give them a listener of their own (--admin-port)",
            ),
        };
        Some(ApiError::new(status, kind, message).into_response())
    }
}
