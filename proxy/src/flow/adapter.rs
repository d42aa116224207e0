//! The model half of placing a request: which model it asks for, loading a LoRA adapter where it is missing
//! (`--lora-load-on-demand`), and telling a model nobody serves (404) from one whose engines
//! are all down or drained (503).

use std::sync::Arc;
use std::time::Instant;

use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;

use super::Refusal;
use crate::backend::Pair;
use crate::body::Body;
use crate::metrics::Outcome;
use crate::models::lora::AdapterLoader;
use crate::state::{AppState, Route};

/// The model a request asks for, as its body names it: `model`, or for SGLang's `/generate`
/// (which has no `model`) its `lora_path` when it is a name.
pub(super) fn requested(route: Route, body: &Body<'_>) -> Option<String> {
    let text = |name: &str| serde_json::from_str::<String>(body.get(name)?.get()).ok();
    text("model").or_else(|| match route {
        Route::Generate => text("lora_path"),
        Route::Completions | Route::ChatCompletions => None,
    })
}

/// When `model` is an adapter that the proxy may load and no ready pair, or no ready decode,
/// has loaded: loads it on the least loaded ready engine of its base model on each side that
/// lacks it (both at once), so that the request then finds a pair and a decode that both have
/// it. Nothing to do otherwise.
pub(super) async fn load_if_missing(
    state: &AppState,
    pairs: &[Arc<Pair>],
    model: &str,
    headers: &HeaderMap,
    deadline: Instant,
) -> Result<(), Refusal> {
    if !state.models.load_on_demand {
        return Ok(());
    }
    let decodes = &state.pool.decodes();
    let ready = |backend: &crate::backend::Backend| backend.is_healthy() && !backend.is_drained();
    let pair_has = pairs
        .iter()
        .any(|pair| pair.takes_requests() && pair.backend.lists(model) == Some(true));
    let decode_has = decodes
        .iter()
        .any(|decode| ready(decode) && decode.lists(model) == Some(true));
    if pair_has && decode_has {
        return Ok(());
    }
    let Some(source) = AdapterLoader::source(&state.models, &state.pool, model) else {
        return Ok(());
    };
    let base = Some(source.base.as_str());
    let prefill = match pair_has {
        true => None,
        false => Some(
            (pairs.iter())
                .filter(|pair| pair.takes_requests() && pair.serves(base))
                .min_by_key(|pair| pair.backend.load())
                .map(|pair| pair.backend.clone())
                .ok_or_else(|| model_unavailable(&source.base, "prefill"))?,
        ),
    };
    let decode = match decode_has {
        true => None,
        false => Some(
            (decodes.iter())
                .filter(|decode| ready(decode) && decode.serves(base))
                .min_by_key(|decode| decode.load())
                .cloned()
                .ok_or_else(|| model_unavailable(&source.base, "decode"))?,
        ),
    };
    let authorization = headers.get(AUTHORIZATION);
    let load = |backend: Option<Arc<crate::backend::Backend>>| {
        let source = &source;
        async move {
            match backend {
                Some(backend) => {
                    (state.lora)
                        .ensure(&backend, model, source, authorization, deadline)
                        .await
                }
                None => Ok(()),
            }
        }
    };
    let (prefill, decode) = tokio::join!(load(prefill), load(decode));
    prefill.and(decode).map_err(|err| {
        super::refused(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!("model `{model}` is not loaded on a ready prefill and decode: {err}"),
            Outcome::Unavailable,
        )
    })
}

/// No ready pair serves `model`: a 404 `model_not_found` when no engine serves it at all (and
/// every engine's models are known), else nothing (the caller tells it is unavailable).
pub(super) fn check_served(
    state: &AppState,
    pairs: &[Arc<Pair>],
    model: &str,
) -> Result<(), Refusal> {
    let pool = &state.pool;
    if crate::models::anyone_serves(pool, pairs, model) || !crate::models::all_known(pool) {
        return Ok(());
    }
    let served = crate::models::served_names(pool, pairs);
    Err(Refusal {
        response: Box::new(crate::models::not_found(model, &served).into_response()),
        outcome: Outcome::ModelNotFound,
    })
}

/// 503 naming `model`, served here, whose `side` engines cannot take the request now.
pub(super) fn model_unavailable(model: &str, side: &str) -> Refusal {
    Refusal {
        response: Box::new(crate::models::unavailable(model, side).into_response()),
        outcome: Outcome::Unavailable,
    }
}
