//! The operator's routes: `GET /admin/backends` shows every backend (health, drain marks,
//! requests in flight through this proxy, idle or not) and `POST /admin/drain` drains a backend
//! at this proxy or lifts that (with `--admin-key`), and `GET /admin/kv-index` shows the index of
//! the engines' KV cache events (with `--admin-key` and `--kv-events`),
//! `POST /admin/kv-index/match` how much of a given prompt each engine holds, and
//! `POST /admin/duties` puts engines of both roles (`--dual`) on the duties named. A rollout drains an engine (here, or for a
//! prefill in its bootstrap server's registry, which reaches every proxy), waits until every
//! proxy shows it idle, restarts it, and lifts the mark.

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use pd_protocol::proxy_admin::{BackendState, Backends, DrainRequest};
use pd_protocol::Rank;
use serde::Serialize;

use crate::error::ApiError;
use crate::state::AppState;
use pd_router::backend::states::{find, state_of, states};
use pd_router::duty::DutiesRequest;
use pd_router::prompt_tokens::PromptKind;
use pd_router::routing::RequestInfo;

/// `GET /admin/backends`: the pool's backends, then those that left it with calls in flight.
pub(crate) async fn backends(State(state): State<AppState>) -> Json<Backends> {
    let (prefills, decodes) = states(state.pool(), |_, backend| backend);
    Json(Backends { prefills, decodes })
}

/// `POST /admin/drain`: drains a prefill or decode at this proxy (no new requests; those in
/// flight finish), or lifts that; answers the backend's state.
pub(crate) async fn drain(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Json<DrainRequest>, JsonRejection>,
) -> Result<Json<BackendState>, ApiError> {
    admitted(&state, &headers, "draining")?;
    let Json(request) = body.map_err(bad_body)?;
    let url = request.url.trim_end_matches('/');
    let backend = find(state.pool(), url).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!("`url`: no prefill or decode {url:?} is configured (see GET /admin/backends)"),
        )
    })?;
    backend.set_drained(request.draining);
    Ok(Json(state_of(&backend, Vec::new(), false)))
}

/// `POST /admin/duties` (with `--admin-key`): puts engines of both roles (`--dual`) on the
/// duties named, all at once, once their new directions are warmed up; answers every dual's
/// duty.
pub(crate) async fn duties(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Json<DutiesRequest>, JsonRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    admitted(&state, &headers, "setting duties")?;
    let Json(request) = body.map_err(bad_body)?;
    let Some(duties) = state.router.duties() else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            "no engine of both roles: start pd-proxy with --dual URL BOOTSTRAP_PORT",
        ));
    };
    let duals = (duties.assign(&request.duties).await)
        .map_err(|err| ApiError::new(err.status(), "invalid_request_error", err.to_string()))?;
    Ok(Json(serde_json::json!({ "duals": duals })))
}

/// A body that is not the route's JSON: 400 with axum's words for what is wrong.
fn bad_body(rejection: JsonRejection) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        rejection.body_text(),
    )
}

/// Whether `headers` carry the admin key (`what` names the action in the refusal).
fn admitted(state: &AppState, headers: &HeaderMap, what: &str) -> Result<(), ApiError> {
    let Some(key) = &state.admin_key else {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            format!("the admin routes are off: start pd-proxy with --admin-key for {what}"),
        ));
    };
    if !key.admits(headers) {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            format!(
                "{what} needs the header Authorization: Bearer <key> with the proxy's --admin-key"
            ),
        ));
    }
    Ok(())
}

/// `GET /admin/kv-index` (with `--admin-key`): the KV-event index, per engine: blocks held,
/// the last sequence applied, gaps and rebuilds.
pub(crate) async fn kv_index(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<pd_router::kv_events::KvIndexReport>, ApiError> {
    admitted(&state, &headers, "the KV index")?;
    let kv = state.router.kv().ok_or_else(no_kv_index)?;
    Ok(Json(kv.report()))
}

/// One engine's share of a prompt, in the answer of `POST /admin/kv-index/match`.
#[derive(Debug, Serialize)]
pub(crate) struct EngineMatch {
    /// `prefill` or `decode`.
    pub role: &'static str,
    /// The backend's URL.
    pub backend: String,
    /// The dp rank.
    pub dp_rank: Rank,
    /// The prompt's leading tokens it holds.
    pub cached_tokens: usize,
}

/// The answer of `POST /admin/kv-index/match`.
#[derive(Debug, Serialize)]
pub(crate) struct PromptMatch {
    /// The prompt's tokens.
    pub prompt_tokens: usize,
    /// Their ids, as the proxy computed them (to compare with the engine's `/tokenize`).
    pub token_ids: Vec<u32>,
    /// Every followed engine, the best placed first.
    pub engines: Vec<EngineMatch>,
}

/// `POST /admin/kv-index/match` (with `--admin-key`): a completion's or chat's body (its
/// `prompt` or `messages`, and `cache_salt`), tokenized as for routing, and how much of it each
/// followed engine holds.
pub(crate) async fn kv_match(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<PromptMatch>, ApiError> {
    admitted(&state, &headers, "the KV index")?;
    let (Some(kv), Some(prompt_tokens)) = (state.router.kv(), state.router.prompt_tokens()) else {
        return Err(no_kv_index());
    };
    let invalid =
        |message: String| ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
    let raw = body;
    let body = pd_router::body::Body::parse(&raw).map_err(|err| invalid(err.to_string()))?;
    let kind = if body.get("messages").is_some() {
        PromptKind::Chat
    } else if body.get("prompt").is_some() {
        PromptKind::Completion
    } else {
        return Err(invalid(
            "`prompt` or `messages`: the body names no prompt".into(),
        ));
    };
    let decodes = state.pool().decodes();
    let engine = decodes.iter().find(|d| d.is_healthy());
    let tokens = prompt_tokens
        .of(kind, &raw, &body, engine.map(|e| &**e))
        .await
        .ok_or_else(|| {
            invalid(
                "`prompt`/`messages`: the prompt could not be tokenized (see the proxy's log)"
                    .into(),
            )
        })?;
    let request = RequestInfo::new(&body, &headers).with_tokens(Some(&tokens));
    let mut engines: Vec<EngineMatch> = kv
        .holders(&request.kv_key(), &tokens)
        .into_iter()
        .map(|held| EngineMatch {
            role: held.backend.role().as_str(),
            backend: held.backend.url().to_owned(),
            dp_rank: held.dp_rank,
            cached_tokens: held.cached_tokens,
        })
        .collect();
    engines.sort_by_key(|e| std::cmp::Reverse(e.cached_tokens));
    Ok(Json(PromptMatch {
        prompt_tokens: tokens.len(),
        token_ids: tokens,
        engines,
    }))
}

fn no_kv_index() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "not_found_error",
        "no KV index: start pd-proxy with --kv-events to follow the engines' KV cache events",
    )
}
