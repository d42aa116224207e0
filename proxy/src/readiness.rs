//! What `GET /ready` answers, and the live page shows: whether a request would find a
//! (prefill, dp rank) pair and a decode serving the same model, every backend, and why not.

use std::collections::BTreeMap;

use pd_protocol::Rank;
use serde::Serialize;

use pd_router::Side;

use crate::state::AppState;

/// One prefill in `GET /ready`.
#[derive(Debug, Serialize)]
pub(crate) struct PrefillReadiness {
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
pub(crate) struct DecodeReadiness {
    /// Its URL.
    pub url: String,
    /// Whether it passes its health checks.
    pub healthy: bool,
    /// The models its `/v1/models` lists (empty until read).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
}

/// Which sides of the fleet are saturated.
#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct Saturation {
    /// Every prefill that could take a request is saturated.
    pub prefills: bool,
    /// Every decode that could take a request is saturated.
    pub decodes: bool,
}

/// The answer of `GET /ready` (200 when ready, 503 otherwise).
#[derive(Debug, Serialize)]
pub(crate) struct Readiness {
    /// `ready` or `not_ready`.
    pub status: &'static str,
    /// (prefill, dp rank) pairs requests can go to.
    pub ready_pairs: usize,
    /// Decodes requests can go to.
    pub healthy_decodes: usize,
    /// Whether every prefill and every decode that could take a request is saturated (the
    /// engines' own signals: see `--saturation-*`).
    pub saturated: Saturation,
    /// Every prefill.
    pub prefills: Vec<PrefillReadiness>,
    /// Every decode.
    pub decodes: Vec<DecodeReadiness>,
    /// Why it is not ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// What `GET /ready` answers.
pub(crate) fn readiness(state: &AppState) -> Readiness {
    let pool = state.pool();
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
    let detail = if state.sidecar {
        // Beside a decode, the gateway's picker chooses the prefills: the sidecar can take
        // requests while its decode can (a decode alone when no prefill is ready).
        (healthy_decodes == 0)
            .then(|| "the decode beside this sidecar is failing its health checks".to_owned())
    } else if healthy_pairs == 0 {
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
        saturated: Saturation {
            prefills: state.router.saturated(Side::Prefill),
            decodes: state.router.saturated(Side::Decode),
        },
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
fn model_ids(backend: &pd_router::backend::Backend) -> Vec<String> {
    let cards = backend.models().unwrap_or_default();
    cards.iter().map(|card| card.id.clone()).collect()
}
