//! The HTTP routes: OpenAI's completions and chats, SGLang's `/generate`, vLLM's `/tokenize`,
//! `/reset_prefix_cache` and `/kv_event_sources`, the model list (and vLLM's LoRA adapter
//! loading, when allowed), health, and the reports; any other path is FastAPI's 404.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pd_service::GateLayer;
use serde_json::{json, Value};

use super::models::{self, MAX_MODEL_LEN};
use super::{caches, report, Engine};
use crate::sim::api::Api;
use crate::sim::failure::Failure;
use crate::sim::tls::ClientCertificateRequired;
use crate::sim::tokens::tokenize_ids;

/// Every route, on `engine`.
pub(super) fn router(engine: Arc<Engine>) -> Router {
    let mut router = Router::new();
    if engine.runtime_lora {
        router = router
            .route("/v1/load_lora_adapter", post(models::load))
            .route("/v1/unload_lora_adapter", post(models::unload));
    }
    let router = router
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/generate", post(generate))
        .route("/tokenize", post(tokenize))
        .route("/reset_prefix_cache", post(caches::reset))
        .route("/kv_event_sources", get(caches::sources))
        .route("/v1/models", get(models::list))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/version", get(version))
        .route("/stats", get(report::stats))
        .route("/metrics", get(report::metrics))
        .fallback(|| async { (StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"}))) })
        .layer(DefaultBodyLimit::max(engine.args.max_body_bytes));
    let router = match engine.args.tls.requires_client_certificates() {
        true => router.layer(GateLayer(ClientCertificateRequired)),
        false => router,
    };
    router.with_state(engine)
}

async fn completions(
    State(engine): State<Arc<Engine>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    engine.handle(Api::Completions, &headers, &body).await
}

async fn chat_completions(
    State(engine): State<Arc<Engine>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    engine.handle(Api::Chat, &headers, &body).await
}

async fn generate(State(engine): State<Arc<Engine>>, headers: HeaderMap, body: Bytes) -> Response {
    engine.handle(Api::Generate, &headers, &body).await
}

/// `POST /tokenize` as vLLM answers it: `{"count", "max_model_len", "tokens", "token_strs"}`.
/// vLLM's `GET /version`: the version `--engine-version` names.
async fn version(State(engine): State<Arc<Engine>>) -> Json<serde_json::Value> {
    Json(json!({"version": engine.args.engine_version}))
}

async fn tokenize(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    let ids = serde_json::from_slice::<Value>(&body)
        .map_err(|err| format!("the body is not JSON: {err}"))
        .and_then(|body| tokenize_ids(&engine.tokenizer, &body));
    match ids {
        Ok(ids) => Json(json!({
            "count": ids.len(), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": null,
        }))
        .into_response(),
        Err(message) => Failure::bad_request(message).into_response(),
    }
}
