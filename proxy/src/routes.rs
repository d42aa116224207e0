//! The routes: the proxied `/v1` ones behind their layers, and `/health`, `/ready`, `/metrics`,
//! with JSON 404 and 405 for anything else.

use std::collections::BTreeMap;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pd_protocol::Rank;
use serde::Serialize;
use tower::ServiceBuilder;

use crate::error::ApiError;
use crate::layers::auth::RequireApiKey;
use crate::layers::request_id::AssignRequestIdLayer;
use crate::layers::track::TrackLayer;
use crate::state::AppState;
use crate::{admin, handler, models, ui};

/// Builds the router: the proxied routes behind their layers (see [`crate::layers`]), the
/// operational ones open.
pub fn router(state: AppState) -> Router {
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
        .route("/v1/models", get(models::models))
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

/// One prefill in `GET /ready`.
#[derive(Debug, Serialize)]
pub struct PrefillReadiness {
    /// Its URL.
    pub url: String,
    /// Its bootstrap server (none: used on its `/health` alone).
    pub bootstrap_addr: Option<String>,
    /// Whether it passes its health checks.
    pub healthy: bool,
    /// Discovered dp rank -> engine id (none without a bootstrap server, or on SGLang's).
    pub dp_ranks: BTreeMap<Rank, Option<String>>,
    /// The models its engines registered, else those it lists at `/v1/models` (empty when
    /// neither is known).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
}

/// One decode in `GET /ready`.
#[derive(Debug, Serialize)]
pub struct DecodeReadiness {
    /// Its URL.
    pub url: String,
    /// Whether it passes its health checks.
    pub healthy: bool,
    /// The models its `/v1/models` lists (empty until read).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
}

/// The answer of `GET /ready` (200 when ready, 503 otherwise).
#[derive(Debug, Serialize)]
pub struct Readiness {
    /// `ready` or `not_ready`.
    pub status: &'static str,
    /// (prefill, dp rank) pairs requests can go to.
    pub ready_pairs: usize,
    /// Decodes requests can go to.
    pub healthy_decodes: usize,
    /// Every prefill.
    pub prefills: Vec<PrefillReadiness>,
    /// Every decode.
    pub decodes: Vec<DecodeReadiness>,
    /// Why it is not ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
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

/// What `GET /ready` answers.
pub fn readiness(state: &AppState) -> Readiness {
    let pool = &state.pool;
    let pairs = pool.pairs();
    let prefills: Vec<PrefillReadiness> = pool
        .prefills()
        .iter()
        .map(|prefill| {
            let mut models: Vec<String> = pairs
                .iter()
                .filter(|pair| std::sync::Arc::ptr_eq(&pair.backend, &prefill.backend))
                .filter_map(|pair| pair.model.as_deref().map(str::to_owned))
                .collect();
            models.dedup();
            if models.is_empty() {
                models = model_ids(&prefill.backend);
            }
            PrefillReadiness {
                url: prefill.backend.url().to_owned(),
                bootstrap_addr: prefill.bootstrap_addr.as_deref().map(str::to_owned),
                healthy: prefill.backend.is_healthy(),
                dp_ranks: prefill
                    .ranks()
                    .into_iter()
                    .map(|(rank, engine)| (rank, engine.as_deref().map(str::to_owned)))
                    .collect(),
                models,
            }
        })
        .collect();
    let healthy_decodes = pool.decodes().iter().filter(|d| d.is_healthy()).count();
    // A pair is ready when its prefill is healthy and a healthy decode serves one of its
    // models (what it lists, else what it registered).
    let ready_pairs = pairs
        .iter()
        .filter(|pair| pair.backend.is_healthy())
        .filter(|pair| {
            let listed = pair.backend.models();
            let models: Vec<Option<&str>> = match listed.as_deref() {
                Some(cards) if pair.model.is_none() && !cards.is_empty() => cards
                    .iter()
                    .filter(|card| !card.is_adapter())
                    .map(|card| Some(card.id.as_str()))
                    .collect(),
                _ => vec![pair.model.as_deref()],
            };
            (pool.decodes().iter())
                .any(|d| d.is_healthy() && models.iter().any(|model| d.serves(*model)))
        })
        .count();
    let decodes: Vec<DecodeReadiness> = pool
        .decodes()
        .iter()
        .map(|decode| DecodeReadiness {
            url: decode.url().to_owned(),
            healthy: decode.is_healthy(),
            models: model_ids(decode),
        })
        .collect();
    let healthy_pairs = pairs
        .iter()
        .filter(|pair| pair.backend.is_healthy())
        .count();
    let detail = if healthy_pairs == 0 {
        Some("no (prefill, dp rank) pair is ready: discovery has not succeeded yet or every prefill is unhealthy".to_owned())
    } else if healthy_decodes == 0 {
        Some("every decode is failing its health checks".to_owned())
    } else if ready_pairs == 0 {
        Some("no healthy decode serves the model of any ready prefill: P and D of different models are never paired".to_owned())
    } else {
        None
    };
    let detail = shutting_down(state).or(detail);
    Readiness {
        status: if detail.is_none() {
            "ready"
        } else {
            "not_ready"
        },
        ready_pairs,
        healthy_decodes,
        prefills,
        decodes,
        detail,
    }
}

/// Why `GET /ready` fails before anything else: the proxy is shutting down (`--shutdown-delay`).
fn shutting_down(state: &AppState) -> Option<String> {
    state.draining.not_ready_reason().map(str::to_owned)
}

/// The ids of the models `backend` lists (empty until read).
fn model_ids(backend: &crate::backend::Backend) -> Vec<String> {
    let cards = backend.models().unwrap_or_default();
    cards.iter().map(|card| card.id.clone()).collect()
}

/// `GET /metrics`: Prometheus text format.
async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}
