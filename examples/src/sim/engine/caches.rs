//! Each dp rank's prefix cache and, with `--kv-events-config`, the publisher of its KV cache
//! events: started with the engine, emptied by `POST /reset_prefix_cache`, and described by
//! `GET /kv_event_sources` (vLLM's answer: the publisher config of every dp rank, endpoints
//! offset and bound; vLLM's dialect only, as SGLang serves no such route; 404 when events are
//! off).
//!
//! Which rank serves a request: in vLLM's dialect the one `X-data-parallel-rank` names (P or
//! D, as vLLM's API server honours it), else 0; in SGLang's the bootstrap room's
//! (`room % dp_size`, as SGLang's `follow_bootstrap_room`), else 0. A decode thus stores the KV
//! it pulled in the cache of the rank serving it, and publishes it there.

use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::{Engine, SimError};
use crate::sim::config::{Dialect, SimArgs};
use crate::sim::kv_events::Publisher;
use crate::sim::prefix_cache::PrefixCache;

/// The prefix cache of every dp rank (none without `--prefix-cache-blocks`) and, when events
/// are on, every rank's publisher.
pub(super) async fn start(args: &SimArgs) -> Result<(Vec<PrefixCache>, Vec<Publisher>), SimError> {
    let events = args.kv_events_config.as_ref().filter(|c| c.enabled());
    let Some(capacity) = NonZeroUsize::new(args.prefix_cache_blocks) else {
        return match events {
            Some(_) => Err(SimError::Flags(
                "--kv-events-config needs --prefix-cache-blocks: the events are the prefix cache's",
            )),
            None => Ok((Vec::new(), Vec::new())),
        };
    };
    let mut publishers = Vec::new();
    if let Some(config) = events {
        for rank in 0..args.dp_size {
            let publisher = Publisher::start(config.for_rank(rank), args.host, rank).await;
            publishers.push(publisher.map_err(SimError::Setup)?);
        }
    }
    let caches = (0..args.dp_size as usize)
        .map(|rank| PrefixCache::new(capacity, publishers.get(rank).map(Publisher::sink)))
        .collect();
    Ok((caches, publishers))
}

/// `POST /reset_prefix_cache`: every rank's cache emptied (`AllBlocksCleared` published);
/// `{"success": true}` as vLLM answers.
pub(super) async fn reset(State(engine): State<Arc<Engine>>) -> Json<serde_json::Value> {
    engine.prefix_caches.iter().for_each(PrefixCache::clear);
    tracing::info!("prefix cache reset");
    Json(json!({"success": true}))
}

/// `GET /kv_event_sources`: each dp rank's publisher config, by rank.
pub(super) async fn sources(State(engine): State<Arc<Engine>>) -> Response {
    if engine.publishers.is_empty() || engine.args.dialect != Dialect::Vllm {
        return StatusCode::NOT_FOUND.into_response();
    }
    let by_rank: BTreeMap<String, _> = engine
        .publishers
        .iter()
        .enumerate()
        .map(|(rank, publisher)| (rank.to_string(), &publisher.config))
        .collect();
    Json(by_rank).into_response()
}
