//! Which followed engines hold how much of a prompt: the index matched once per block size the
//! engines use, each engine named as the policies name their candidates (a prefill's dp rank
//! as its (prefill, dp rank) pair, a decode as its backend).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use pd_protocol::Rank;

use super::KvTracker;
use crate::backend::{pair_id, Backend, Role};
use crate::kv_index::RequestKey;
use crate::sync::lock;

/// How much of a prompt one followed engine holds.
#[derive(Clone)]
pub struct Held {
    /// The engine's backend.
    pub backend: Arc<Backend>,
    /// The engine's dp rank.
    pub dp_rank: Rank,
    /// The candidate identity the policies see: the pair's for a prefill, the backend's for a
    /// decode.
    pub owner: u64,
    /// The prompt's leading tokens it holds (whole blocks).
    pub cached_tokens: usize,
}

impl KvTracker {
    /// Every engine whose events are followed now (subscribed), with how many of `tokens`'
    /// leading tokens it holds under `key`.
    pub fn holders(&self, key: &RequestKey<'_>, tokens: &[u32]) -> Vec<Held> {
        // A snapshot first (slot, engine, block size): the index is read without the engines'
        // lock held.
        let mut engines: Vec<(usize, Held, usize)> = lock(&self.engines)
            .iter()
            .enumerate()
            .filter_map(|(slot, e)| Some((slot, e.as_ref()?)))
            .filter(|(_, e)| e.feed.connected.load(Ordering::Relaxed))
            .map(|(slot, e)| {
                let owner = match e.backend.role() {
                    Role::Prefill => pair_id(e.backend.id(), e.source.dp_rank),
                    Role::Decode => e.backend.id(),
                };
                let held = Held {
                    backend: e.backend.clone(),
                    dp_rank: e.source.dp_rank,
                    owner,
                    cached_tokens: 0,
                };
                (
                    slot,
                    held,
                    e.feed.block_size.load(Ordering::Relaxed) as usize,
                )
            })
            .collect();
        let mut sizes: Vec<usize> = engines.iter().map(|e| e.2).filter(|&s| s > 0).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let index = self.read_index();
        for size in sizes {
            for (slot, blocks) in index.match_prefix(key, tokens, size) {
                let engine = engines
                    .iter_mut()
                    .find(|e| e.0 == slot.0 as usize && e.2 == size);
                if let Some(engine) = engine {
                    engine.1.cached_tokens = blocks * size;
                }
            }
        }
        engines.into_iter().map(|(_, held, _)| held).collect()
    }
}
