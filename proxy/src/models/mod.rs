//! Many models behind one proxy: which engines serve which model, and what a request for a
//! model becomes.
//!
//! Every backend (prefill and decode) carries the [`ModelCard`]s its `GET /v1/models` lists,
//! read at each of its health checks: its base model and, on vLLM, the LoRA adapters it has
//! loaded (`parent` naming the base). A prefill's dp rank that has not been read yet serves the
//! model its engine registered (native API), or anything. A request's model (`model`, after the
//! `--config` file's aliases) narrows the candidates of both picks to the engines that serve
//! it, so P and D of a request serve the same model; the policy (the model's own, from the
//! file, or the flags') chooses inside that pool. A model nobody serves is a 404
//! `model_not_found` naming the served ones; a model whose engines are all down or drained, a
//! 503 naming it. An adapter nobody ready has loaded may be loaded on demand ([`lora`]).
//! `GET /v1/models` answers the union ([`list`]); the metrics label requests by model,
//! within bounds ([`labels`]).

mod labels;
mod list;
pub mod lora;
pub mod settings;

pub use crate::backend::{read_cards, ModelCard};
pub use labels::{ModelHandles, ModelLabels};
pub use list::models;
pub use settings::{AdapterSource, ModelPolicies, ModelsArgs, ModelsConfig};

use std::collections::BTreeSet;

use axum::http::StatusCode;

use crate::backend::{Pair, Pool};
use crate::error::ApiError;

/// Whether any backend (healthy or not) lists `model`, or a prefill's engine registered it.
pub fn anyone_serves(pool: &Pool, pairs: &[std::sync::Arc<Pair>], model: &str) -> bool {
    let backends = pool.backends();
    let listed = (backends.iter()).any(|backend| backend.lists(model) == Some(true));
    listed
        || pairs
            .iter()
            .any(|pair| pair.model.as_deref() == Some(model))
}

/// Whether every backend's model list is known (a model none of them lists is then served
/// nowhere).
pub fn all_known(pool: &Pool) -> bool {
    (pool.backends().iter()).all(|backend| backend.models().is_some())
}

/// Every model served here: what the backends list and what prefills registered.
pub fn served_names(pool: &Pool, pairs: &[std::sync::Arc<Pair>]) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for backend in pool.backends() {
        for card in backend.models().unwrap_or_default().iter() {
            names.insert(card.id.clone());
        }
    }
    names.extend(
        pairs
            .iter()
            .filter_map(|pair| pair.model.as_deref().map(str::to_owned)),
    );
    names
}

/// 404 `model_not_found`, in OpenAI's shape, naming `model` and what is served.
pub fn not_found(model: &str, served: &BTreeSet<String>) -> ApiError {
    let list: Vec<&str> = served.iter().map(String::as_str).collect();
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!(
            "The model `{model}` does not exist here. Served models: {}.",
            if list.is_empty() {
                "none yet".to_owned()
            } else {
                list.join(", ")
            }
        ),
    )
    .with_code("model_not_found")
    .with_param("model")
}

/// 503: `model` is served here, but none of its engines can take a request now.
pub fn unavailable(model: &str, side: &str) -> ApiError {
    ApiError::unavailable(format!(
        "model `{model}`: no {side} serving it is ready (every one is failing its health \
         checks, drained, or not discovered yet; see GET /ready)"
    ))
}
