//! [`Prefill`]: one prefill server and what discovery learnt about it (dp ranks, models,
//! drain marks).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use pd_protocol::native::WorkerInfo;
use pd_protocol::Rank;
use tokio::sync::Notify;

use super::{Backend, Pair};
use crate::metrics::DiscoveryMetrics;
use crate::sync::lock;

/// One prefill server and what discovery learnt about it.
pub struct Prefill {
    /// The server.
    pub backend: Arc<Backend>,
    /// Its bootstrap server, e.g. `http://10.0.0.5:8998` (none: it is used on its `/health`
    /// alone, as dp rank 0).
    pub bootstrap_addr: Option<Arc<str>>,
    /// Woken to make discovery run now (D reported an unknown engine, or P came back).
    pub refresh: Notify,
    /// Discovery metrics.
    pub discovery_metrics: DiscoveryMetrics,
    pub(super) pairs: Mutex<Vec<Arc<Pair>>>,
    /// engine id -> the model it registered, from the bootstrap server's watch.
    pub(super) models: Mutex<HashMap<String, Arc<str>>>,
    /// Engine ids marked draining in the registry, from the bootstrap server's watch.
    pub(super) draining: Mutex<HashSet<String>>,
}

impl Prefill {
    /// The models the engines registered, by engine id.
    pub fn models(&self) -> HashMap<String, Arc<str>> {
        lock(&self.models).clone()
    }

    /// Learns the models and drain marks of `workers` (all of them when `whole`: a full list)
    /// and marks the known dp ranks of draining engines at once.
    pub fn learn(&self, workers: &[WorkerInfo], whole: bool) {
        let mut models = lock(&self.models);
        let mut draining = lock(&self.draining);
        if whole {
            models.clear();
            draining.clear();
        }
        for worker in workers {
            let Some(engine) = &worker.engine_id else {
                continue;
            };
            if let Some(model) = &worker.meta.model {
                models.insert(engine.clone(), Arc::from(model.as_str()));
            }
            if worker.draining {
                draining.insert(engine.clone());
            } else {
                draining.remove(engine);
            }
        }
        for pair in lock(&self.pairs).iter() {
            let Some(engine_id) = pair.engine_id.as_deref() else {
                continue;
            };
            let marked = draining.contains(engine_id);
            if pair.draining.swap(marked, Ordering::Relaxed) != marked {
                tracing::info!(
                    prefill = self.backend.url(),
                    engine_id,
                    draining = marked,
                    "registry drain mark"
                );
            }
        }
    }

    /// Its (prefill, dp rank) pairs, by rank.
    pub fn pairs(&self) -> Vec<Arc<Pair>> {
        lock(&self.pairs).clone()
    }

    /// The dp ranks and engine ids currently known, by rank.
    pub fn ranks(&self) -> Vec<(Rank, Option<Arc<str>>)> {
        lock(&self.pairs)
            .iter()
            .map(|pair| (pair.dp_rank, pair.engine_id.clone()))
            .collect()
    }
}
