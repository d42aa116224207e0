//! [`Pool`]: every backend, and the snapshot of (prefill, dp rank) pairs requests choose from.
//! Backends come and go (DNS discovery): each list is a snapshot replaced whole, so a request
//! reads a consistent one with a pointer copy, and a backend that leaves keeps serving the
//! calls that hold it until they end.

use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use reqwest::header::HeaderValue;

use super::{Backend, DiscoveredRank, Pair, Prefill, Role};
use crate::config::{PrefillTarget, RouterConfig};
use crate::duty::{Dual, Duty};
use crate::metrics::FleetMetrics;
use crate::sync::lock;

/// Every backend, and the snapshot of (prefill, dp rank) pairs requests choose from.
pub struct Pool {
    prefills: RwLock<Arc<[Arc<Prefill>]>>,
    decodes: RwLock<Arc<[Arc<Backend>]>>,
    pairs: RwLock<Arc<[Arc<Pair>]>>,
    /// The engines of both roles (`--dual`), each also among the prefills and the decodes.
    duals: Arc<[Arc<Dual>]>,
    departed: Mutex<Departed>,
}

/// Backends taken out of the pool while calls to them were in flight: still worth showing
/// (a drain waits for those calls) until the last one ends.
#[derive(Default, Clone)]
pub struct Departed {
    /// Prefills that left.
    pub prefills: Vec<Arc<Prefill>>,
    /// Decodes that left.
    pub decodes: Vec<Arc<Backend>>,
}

impl Departed {
    /// Forgets those with no call in flight any more.
    fn prune(&mut self) {
        self.prefills.retain(|p| p.backend.outstanding() > 0);
        self.decodes.retain(|d| d.outstanding() > 0);
    }
}

fn read<T: ?Sized>(list: &RwLock<Arc<T>>) -> Arc<T> {
    list.read().unwrap_or_else(PoisonError::into_inner).clone()
}

impl Pool {
    /// Whether every decode that could take a request for `model` now is saturated (and there
    /// is one).
    pub fn decodes_saturated(&self, model: Option<&str>) -> bool {
        all_saturated(
            (self.decodes().iter())
                .filter(|d| d.takes_requests(model))
                .map(|d| d.is_saturated()),
        )
    }

    /// Whether every prefill that could take a request for `model` now is saturated (and there
    /// is one).
    pub fn prefills_saturated(&self, model: Option<&str>) -> bool {
        all_saturated(
            (self.prefills().iter())
                .filter(|p| p.backend.takes_requests(model))
                .map(|p| p.backend.is_saturated()),
        )
    }

    /// Whether a request for `model` finds every engine that could take it saturated: all its
    /// decodes, or (`with_prefills`: a fleet with prefills) all its prefills.
    pub fn saturated(&self, model: Option<&str>, with_prefills: bool) -> bool {
        self.decodes_saturated(model) || (with_prefills && self.prefills_saturated(model))
    }

    /// The backends of `config`'s flags, with no dp rank discovered yet; the first
    /// `--dual-prefills` engines of both roles (half, rounded up, by default) on prefill duty.
    pub fn new(config: &RouterConfig, metrics: &FleetMetrics) -> Self {
        let mut prefills: Vec<Arc<Prefill>> = (config.prefills.iter())
            .map(|target| Arc::new(Prefill::new(target, metrics)))
            .collect();
        let mut decodes: Vec<Arc<Backend>> = (config.decodes.iter())
            .map(|url| Arc::new(Backend::new(Role::Decode, url, metrics)))
            .collect();
        let on_prefill = (config.duty.initial_prefills).unwrap_or(config.duals.len().div_ceil(2));
        let duals: Vec<Arc<Dual>> = (config.duals.iter().enumerate())
            .map(|(at, target)| {
                let prefill = Arc::new(Prefill::new(target, metrics));
                let decode = Arc::new(Backend::new(Role::Decode, &target.url, metrics));
                prefills.push(prefill.clone());
                decodes.push(decode.clone());
                let duty = if at < on_prefill {
                    Duty::Prefill
                } else {
                    Duty::Decode
                };
                Arc::new(Dual::new(prefill, decode, duty))
            })
            .collect();
        Pool {
            prefills: RwLock::new(Arc::from(prefills)),
            decodes: RwLock::new(Arc::from(decodes)),
            pairs: RwLock::new(Arc::from(Vec::new())),
            duals: Arc::from(duals),
            departed: Mutex::default(),
        }
    }

    /// The engines of both roles (`--dual`).
    pub fn duals(&self) -> Arc<[Arc<Dual>]> {
        self.duals.clone()
    }

    /// Whether `backend` is one role of an engine of both roles.
    pub fn is_dual(&self, backend: &Backend) -> bool {
        (self.duals.iter()).any(|dual| {
            std::ptr::eq(&*dual.decode, backend) || std::ptr::eq(&*dual.prefill.backend, backend)
        })
    }

    /// The prefills, in the order they joined.
    pub fn prefills(&self) -> Arc<[Arc<Prefill>]> {
        read(&self.prefills)
    }

    /// The context length (`max_model_len`) of `model` as the first decode whose card gives
    /// one says (see [`Backend::context_length`]).
    pub fn context_length(&self, model: Option<&str>) -> Option<u64> {
        (self.decodes().iter()).find_map(|decode| decode.context_length(model))
    }

    /// The decodes, in the order they joined.
    pub fn decodes(&self) -> Arc<[Arc<Backend>]> {
        read(&self.decodes)
    }

    /// Every backend: the prefills' then the decodes.
    pub fn backends(&self) -> Vec<Arc<Backend>> {
        let prefills = self.prefills();
        let prefills = prefills.iter().map(|prefill| prefill.backend.clone());
        prefills.chain(self.decodes().iter().cloned()).collect()
    }

    /// The current (prefill, dp rank) pairs, healthy or not.
    pub fn pairs(&self) -> Arc<[Arc<Pair>]> {
        read(&self.pairs)
    }

    /// The prefill whose server is `backend`.
    pub fn prefill_of(&self, backend: &Arc<Backend>) -> Option<Arc<Prefill>> {
        let prefills = self.prefills();
        let found = prefills.iter().find(|p| Arc::ptr_eq(&p.backend, backend));
        found.cloned()
    }

    /// Adds a prefill (its dp ranks come with its discovery).
    pub fn add_prefill(&self, prefill: Arc<Prefill>) {
        let mut list = self
            .prefills
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        *list = list.iter().cloned().chain([prefill]).collect();
    }

    /// Adds a decode.
    pub fn add_decode(&self, decode: Arc<Backend>) {
        let mut list = self.decodes.write().unwrap_or_else(PoisonError::into_inner);
        *list = list.iter().cloned().chain([decode]).collect();
    }

    /// Takes `backend` out: no request picks it (or, for a prefill, its dp ranks) from now on;
    /// calls already holding it finish, and until they have it is among the [`Departed`].
    pub fn remove(&self, backend: &Arc<Backend>) {
        let mut departed = lock(&self.departed);
        {
            let mut list = self
                .prefills
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            let (gone, kept): (Vec<_>, Vec<_>) =
                (list.iter().cloned()).partition(|p| Arc::ptr_eq(&p.backend, backend));
            departed.prefills.extend(gone);
            *list = kept.into();
        }
        {
            let mut list = self.decodes.write().unwrap_or_else(PoisonError::into_inner);
            let (gone, kept): (Vec<_>, Vec<_>) =
                (list.iter().cloned()).partition(|d| Arc::ptr_eq(d, backend));
            departed.decodes.extend(gone);
            *list = kept.into();
        }
        departed.prune();
        drop(departed);
        self.refresh_pairs();
    }

    /// The backends that left with calls in flight that have not ended yet.
    pub fn departed(&self) -> Departed {
        let mut departed = lock(&self.departed);
        departed.prune();
        departed.clone()
    }

    /// Rebuilds the pairs' snapshot from the prefills'.
    fn refresh_pairs(&self) {
        let mut snapshot = self.pairs.write().unwrap_or_else(PoisonError::into_inner);
        let all: Vec<Arc<Pair>> = self
            .prefills()
            .iter()
            .flat_map(|prefill| lock(&prefill.pairs).clone())
            .collect();
        *snapshot = Arc::from(all);
    }

    /// Replaces what is known about `prefill` with `ranks` (sorted by rank). Pairs whose rank,
    /// engine id and model did not change are kept, with their load counters. Returns whether
    /// anything changed.
    pub fn set_ranks(&self, prefill: &Prefill, ranks: &[DiscoveredRank<'_>]) -> bool {
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
        self.refresh_pairs();
        true
    }
}

impl Prefill {
    /// The prefill of `target`, nothing discovered yet.
    pub fn new(target: &PrefillTarget, metrics: &FleetMetrics) -> Self {
        Prefill {
            backend: Arc::new(Backend::new(Role::Prefill, &target.url, metrics)),
            bootstrap_addr: target.bootstrap_addr.as_deref().map(Arc::from),
            refresh: tokio::sync::Notify::new(),
            discovery_metrics: metrics.discovery(&target.url),
            pairs: std::sync::Mutex::new(Vec::new()),
            models: std::sync::Mutex::default(),
            draining: std::sync::Mutex::default(),
        }
    }
}

/// Whether there is at least one and all are saturated.
fn all_saturated(saturated: impl Iterator<Item = bool>) -> bool {
    let mut any = false;
    for saturated in saturated {
        if !saturated {
            return false;
        }
        any = true;
    }
    any
}
