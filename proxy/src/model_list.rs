//! `GET /v1/models`: every model the healthy engines serve, once each, in OpenAI's list shape:
//! each engine's own card (`owned_by`, `root`, `parent` for an adapter, `max_model_len`), the
//! first healthy engine's when several list one; the models prefills registered but whose
//! engines' lists are not read yet, as plain cards. Aliases are not listed: they are this
//! proxy's names for served models.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::Json;
use serde_json::{json, Value};

use crate::state::AppState;
use pd_router::models::ModelCard;

/// `GET /v1/models`: the union of the healthy engines' models.
pub(crate) async fn models(State(state): State<AppState>) -> Json<Value> {
    let pool = state.pool();
    let mut cards: BTreeMap<String, Value> = BTreeMap::new();
    for backend in pool.backends() {
        if !backend.is_healthy() {
            continue;
        }
        for card in backend.models().unwrap_or_default().iter() {
            cards
                .entry(card.id.clone())
                .or_insert_with(|| card.raw.clone());
        }
    }
    for pair in pool.pairs().iter() {
        if let Some(model) = pair.model.as_deref() {
            if pair.backend.is_healthy() && pair.backend.models().is_none() {
                cards
                    .entry(model.to_owned())
                    .or_insert_with(|| ModelCard::named(model, None, None).raw);
            }
        }
    }
    Json(json!({"object": "list", "data": cards.into_values().collect::<Vec<_>>()}))
}
