//! Many models behind one fleet: which engines serve which model.
//!
//! Every backend (prefill and decode) carries the [`ModelCard`]s its `GET /v1/models` lists,
//! read at each of its health checks: its base model and, on vLLM, the LoRA adapters it has
//! loaded (`parent` naming the base). A prefill's dp rank that has not been read yet serves the
//! model its engine registered (native API), or anything. A request's model (`model`, after the
//! `--config` file's aliases) narrows the candidates of both picks to the engines that serve
//! it, so P and D of a request serve the same model; the policy (the model's own, from the
//! file, or the flags') chooses inside that pool. An adapter nobody ready has loaded may be
//! loaded on demand ([`lora`]).

pub mod lora;
pub mod settings;

pub use crate::backend::{read_cards, ModelCard};
pub use settings::{AdapterSource, ModelPolicies, ModelsArgs, ModelsConfig};

use std::collections::BTreeSet;

use bytes::Bytes;

use crate::backend::{Pair, Pool};
use crate::body::{raw_json, Body, Edit};

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

/// The model a request's body asks for: its `model`, or for SGLang's `/generate`
/// (`by_lora_path`: it has no `model`) its `lora_path` when it is a name.
pub fn requested(body: &Body<'_>, by_lora_path: bool) -> Option<String> {
    let text = |name: &str| serde_json::from_str::<String>(body.get(name)?.get()).ok();
    text("model").or_else(|| by_lora_path.then(|| text("lora_path")).flatten())
}

/// The body naming `model` in place of `asked`, its alias (in `model`, or `lora_path` when
/// the body has no `model`); `None` when no alias was used.
pub fn aliased(body: &Body<'_>, asked: Option<&str>, model: Option<&str>) -> Option<Bytes> {
    match (asked, model) {
        (Some(asked), Some(model)) if asked != model => {
            let field = match body.get("model") {
                Some(_) => "model",
                None => "lora_path",
            };
            Some(Bytes::from(
                body.render(&[Edit::Replace(field, &raw_json(&model))]),
            ))
        }
        _ => None,
    }
}
