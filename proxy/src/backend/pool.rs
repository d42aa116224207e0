//! [`Pool`]: every backend, and the snapshot of (prefill, dp rank) pairs requests choose from.

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use reqwest::header::HeaderValue;
use tokio::sync::Notify;

use super::{Backend, DiscoveredRank, Pair, Prefill, Role};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::sync::lock;

/// Every backend, and the snapshot of (prefill, dp rank) pairs requests choose from.
pub struct Pool {
    /// The prefills, in flag order.
    pub prefills: Vec<Arc<Prefill>>,
    /// The decodes, in flag order.
    pub decodes: Vec<Arc<Backend>>,
    pairs: RwLock<Arc<[Arc<Pair>]>>,
}

impl Pool {
    /// The backends of `config`, with no dp rank discovered yet.
    pub fn new(config: &Config, metrics: &Metrics) -> Self {
        let prefills = config
            .prefills
            .iter()
            .map(|target| {
                Arc::new(Prefill {
                    backend: Arc::new(Backend::new(Role::Prefill, &target.url, metrics)),
                    bootstrap_addr: target.bootstrap_addr.as_deref().map(Arc::from),
                    refresh: Notify::new(),
                    discovery_metrics: metrics.discovery(&target.url),
                    pairs: Mutex::new(Vec::new()),
                    models: Mutex::default(),
                    draining: Mutex::default(),
                })
            })
            .collect();
        let decodes = config
            .decodes
            .iter()
            .map(|url| Arc::new(Backend::new(Role::Decode, url, metrics)))
            .collect();
        Pool {
            prefills,
            decodes,
            pairs: RwLock::new(Arc::from(Vec::new())),
        }
    }

    /// The current (prefill, dp rank) pairs, healthy or not.
    pub fn pairs(&self) -> Arc<[Arc<Pair>]> {
        self.pairs
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Replaces what is known about prefill `index` with `ranks` (sorted by rank). Pairs whose
    /// rank, engine id and model did not change are kept, with their load counters. Returns
    /// whether anything changed.
    pub fn set_ranks(&self, index: usize, ranks: &[DiscoveredRank<'_>]) -> bool {
        let prefill = &self.prefills[index];
        let same = |pair: &Pair, rank: &DiscoveredRank<'_>| {
            pair.dp_rank == rank.rank
                && pair.engine_id.as_deref() == rank.engine_id
                && pair.model.as_deref() == rank.model
                && pair.dp_size == rank.dp_size
        };
        // Read before the pairs are locked: `Prefill::learn` takes these locks the other way.
        let draining = lock(&prefill.draining).clone();
        {
            let mut pairs = lock(&prefill.pairs);
            let unchanged = pairs.len() == ranks.len()
                && pairs.iter().zip(ranks).all(|(pair, rank)| same(pair, rank));
            if unchanged {
                return false;
            }
            let updated = ranks
                .iter()
                .map(|rank| {
                    pairs
                        .iter()
                        .find(|pair| same(pair, rank))
                        .cloned()
                        .unwrap_or_else(|| {
                            Arc::new(Pair {
                                prefill_index: index,
                                backend: prefill.backend.clone(),
                                bootstrap_addr: prefill.bootstrap_addr.clone(),
                                dp_rank: rank.rank,
                                rank_header: HeaderValue::from(rank.rank),
                                engine_id: rank.engine_id.map(Arc::from),
                                kv_source: prefill
                                    .bootstrap_addr
                                    .as_deref()
                                    .zip(rank.engine_id)
                                    .map(|(addr, engine)| crate::body::kv_source(addr, engine)),
                                model: rank.model.map(Arc::from),
                                dp_size: rank.dp_size,
                                outstanding: AtomicUsize::new(0),
                                draining: AtomicBool::new(
                                    rank.engine_id.is_some_and(|e| draining.contains(e)),
                                ),
                            })
                        })
                })
                .collect();
            *pairs = updated;
            prefill.discovery_metrics.dp_ranks.set(ranks.len() as i64);
        }
        let mut snapshot = self.pairs.write().unwrap_or_else(PoisonError::into_inner);
        let all: Vec<Arc<Pair>> = self
            .prefills
            .iter()
            .flat_map(|prefill| lock(&prefill.pairs).clone())
            .collect();
        *snapshot = Arc::from(all);
        true
    }
}
