//! What the proxy knows about each backend: health, load, and for prefills the dp ranks and
//! engine ids discovered on their bootstrap servers.
//!
//! Everything a request reads is an atomic or a snapshot behind a lock held for a pointer copy;
//! no lock is ever held across an await.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use pd_protocol::native::WorkerInfo;
use pd_protocol::Rank;
use reqwest::header::HeaderValue;
use reqwest::Url;
use tokio::sync::Notify;

use crate::config::{Config, HealthConfig};
use crate::endpoint::Endpoint;
use crate::metrics::{BackendMetrics, CallOutcome, DiscoveryMetrics, Metrics};

/// Whether a backend prefills or decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A prefill (P) server.
    Prefill,
    /// A decode (D) server.
    Decode,
}

impl Role {
    /// The `role` metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// [`Backend::engine_load`] before (or without) a report.
const UNKNOWN: usize = usize::MAX;

/// A hash of a backend's role and URL.
fn identity(role: Role, url: &str) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = foldhash::fast::FixedState::with_seed(0x1d).build_hasher();
    h.write(role.as_str().as_bytes());
    h.write(url.as_bytes());
    h.finish()
}

/// One P or D server.
pub struct Backend {
    url: String,
    id: u64,
    role: Role,
    /// `{url}/v1/completions`.
    pub completions_url: Endpoint,
    /// `{url}/v1/chat/completions`.
    pub chat_completions_url: Endpoint,
    /// `{url}/generate` (SGLang).
    pub generate_url: Endpoint,
    /// `{url}/v1/models`.
    pub models_url: Url,
    /// `{url}/health`.
    pub health_url: Url,
    /// `{url}/metrics` (the engine's own).
    pub metrics_url: Url,
    healthy: AtomicBool,
    /// The models the backend lists at `/v1/models` (empty until known).
    models: RwLock<Arc<[String]>>,
    failures: AtomicU32,
    successes: AtomicU32,
    outstanding: AtomicUsize,
    /// Drained by an operator at this proxy (`POST /admin/drain`).
    drained: AtomicBool,
    /// Requests running and waiting as the engine reports them ([`UNKNOWN`]: not known).
    engine_load: AtomicUsize,
    metrics: BackendMetrics,
}

impl Backend {
    /// A backend at `url` (a base URL without trailing slash), healthy until checks say otherwise.
    pub fn new(role: Role, url: &str, metrics: &Metrics) -> Self {
        let join = |path: &str| {
            Url::parse(&format!("{url}{path}")).expect("a checked base URL plus a path is a URL")
        };
        let metrics = metrics.backend(role.as_str(), url);
        metrics.healthy.set(1);
        Backend {
            url: url.to_owned(),
            id: identity(role, url),
            role,
            completions_url: Endpoint::new(join("/v1/completions")),
            chat_completions_url: Endpoint::new(join("/v1/chat/completions")),
            generate_url: Endpoint::new(join("/generate")),
            models_url: join("/v1/models"),
            health_url: join("/health"),
            metrics_url: join("/metrics"),
            healthy: AtomicBool::new(true),
            models: RwLock::new(Arc::from(Vec::new())),
            failures: AtomicU32::new(0),
            successes: AtomicU32::new(0),
            outstanding: AtomicUsize::new(0),
            drained: AtomicBool::new(false),
            engine_load: AtomicUsize::new(UNKNOWN),
            metrics,
        }
    }

    /// The base URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A stable identity for the policies: the same role and URL, the same id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Prefill or decode.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Requests running and waiting at the engine, as it last reported them.
    pub fn engine_load(&self) -> Option<usize> {
        Some(self.engine_load.load(Ordering::Relaxed)).filter(|load| *load != UNKNOWN)
    }

    /// Records what the engine reported (`None`: nothing usable).
    pub fn set_engine_load(&self, load: Option<usize>) {
        let load = load.map_or(UNKNOWN, |l| l.min(UNKNOWN - 1));
        self.engine_load.store(load, Ordering::Relaxed);
        self.metrics
            .engine_load
            .set(if load == UNKNOWN { -1 } else { load as i64 });
    }

    /// The load the policies see: requests in flight through this proxy, or what the engine
    /// reports running and waiting when that is more (other proxies' and clients' traffic).
    pub fn load(&self) -> usize {
        self.outstanding().max(self.engine_load().unwrap_or(0))
    }

    /// Whether an operator drained it at this proxy: it gets no new requests.
    pub fn is_drained(&self) -> bool {
        self.drained.load(Ordering::Relaxed)
    }

    /// Drains it at this proxy, or lifts that.
    pub fn set_drained(&self, drained: bool) {
        if self.drained.swap(drained, Ordering::Relaxed) != drained {
            tracing::info!(backend = %self.url, role = self.role.as_str(), drained, "drain mark set at this proxy");
        }
    }

    /// Whether the backend passes its health checks (true until enough checks failed).
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// The models the backend serves, as its `/v1/models` listed them (empty: not known yet).
    pub fn models(&self) -> Arc<[String]> {
        self.models
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records the models the backend serves.
    pub fn set_models(&self, models: Vec<String>) {
        *self.models.write().unwrap_or_else(PoisonError::into_inner) = Arc::from(models);
    }

    /// Whether the backend may serve `model`: it lists it, or nothing is known (of the
    /// backend's models, or of the model).
    pub fn serves(&self, model: Option<&str>) -> bool {
        let Some(model) = model else { return true };
        let models = self.models.read().unwrap_or_else(PoisonError::into_inner);
        models.is_empty() || models.iter().any(|m| m == model)
    }

    /// Calls through this proxy not yet finished.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Records one health check; returns the new state when it changed. The backend's one
    /// health-check task calls this; [`Backend::eject`] may also reset the streaks.
    pub fn record_check(&self, passed: bool, config: &HealthConfig) -> Option<bool> {
        let healthy = self.is_healthy();
        if passed {
            self.failures.store(0, Ordering::Relaxed);
            let streak = self.successes.fetch_add(1, Ordering::Relaxed) + 1;
            if !healthy && streak >= config.success_threshold {
                self.set_healthy(true);
                return Some(true);
            }
        } else {
            self.successes.store(0, Ordering::Relaxed);
            let streak = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
            if healthy && streak >= config.failure_threshold {
                self.set_healthy(false);
                return Some(false);
            }
        }
        None
    }

    /// Takes the backend out at once because real traffic says it is dead (`why`: a refused
    /// connection, or a prefill that did not answer within its timeout), not a blip. Active
    /// health checks bring it back after `--health-success-threshold` passes.
    pub fn eject(&self, why: &str) {
        self.successes.store(0, Ordering::Relaxed);
        if self.healthy.swap(false, Ordering::Relaxed) {
            self.metrics.healthy.set(0);
            tracing::warn!(backend = %self.url, role = self.role.as_str(), "{why}: backend taken out until it passes health checks");
        }
    }

    fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::Relaxed);
        self.metrics.healthy.set(i64::from(healthy));
    }

    /// Starts a call: counts it as outstanding and in flight until the guard is finished or
    /// dropped (a dropped guard counts as cancelled).
    pub fn call(self: &Arc<Self>) -> Call {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        self.metrics.in_flight.inc();
        Call {
            backend: self.clone(),
            pair: None,
            finished: false,
        }
    }
}

/// One call to a backend in flight; see [`Backend::call`].
pub struct Call {
    backend: Arc<Backend>,
    pair: Option<Arc<Pair>>,
    finished: bool,
}

impl Call {
    /// The backend called.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// Counts the call as ended with `outcome`.
    pub fn finish(mut self, outcome: CallOutcome) {
        self.finished = true;
        if outcome == CallOutcome::ConnectError {
            self.backend.eject("connection refused");
        }
        self.backend.metrics.call(outcome);
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if !self.finished {
            self.backend.metrics.call(CallOutcome::Cancelled);
        }
        self.backend.outstanding.fetch_sub(1, Ordering::Relaxed);
        self.backend.metrics.in_flight.dec();
        if let Some(pair) = &self.pair {
            pair.outstanding.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// One dp rank of one prefill: what a request's P half is sent to.
pub struct Pair {
    /// The index of the prefill in [`Pool::prefills`].
    pub prefill_index: usize,
    /// The prefill server.
    pub backend: Arc<Backend>,
    /// Its bootstrap server (`remote_bootstrap_addr`).
    pub bootstrap_addr: Arc<str>,
    /// The dp rank.
    pub dp_rank: Rank,
    /// The dp rank as the `X-data-parallel-rank` header value.
    pub rank_header: HeaderValue,
    /// The engine id of that dp rank (`remote_engine_id`).
    pub engine_id: Arc<str>,
    /// The model the engine registered (`None` when its registration or its server does not
    /// say): only decodes that serve it are paired with it.
    pub model: Option<Arc<str>>,
    /// How many dp ranks the prefill has (SGLang's bootstrap rooms encode the rank modulo it).
    pub dp_size: Rank,
    outstanding: AtomicUsize,
    /// Its engine is marked draining in the registry (learnt from the bootstrap server's watch).
    draining: AtomicBool,
}

/// One discovered dp rank of a prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiscoveredRank<'a> {
    /// The dp rank.
    pub rank: Rank,
    /// Its engine id.
    pub engine_id: &'a str,
    /// The model its engine registered, if it did.
    pub model: Option<&'a str>,
    /// How many dp ranks the prefill has.
    pub dp_size: Rank,
}

impl Pair {
    /// A stable identity for the policies: the prefill's and the dp rank's.
    pub fn id(&self) -> u64 {
        self.backend.id() ^ u64::from(self.dp_rank).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    /// Whether requests may be sent to this dp rank: its prefill is healthy and drained
    /// neither at this proxy nor in the registry.
    pub fn takes_requests(&self) -> bool {
        self.backend.is_healthy()
            && !self.backend.is_drained()
            && !self.draining.load(Ordering::Relaxed)
    }

    /// The load the policies see: P calls to this dp rank in flight through this proxy, or its
    /// share of what the prefill's engine reports, when that is more.
    pub fn load(&self) -> usize {
        let share = self.backend.engine_load().unwrap_or(0) / self.dp_size.max(1) as usize;
        self.outstanding().max(share)
    }

    /// Whether its engine is marked draining in the registry.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// P calls to this dp rank not yet finished.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Starts a P call to this dp rank (counted on the pair and on the prefill).
    pub fn call(self: &Arc<Self>) -> Call {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        let mut call = self.backend.call();
        call.pair = Some(self.clone());
        call
    }
}

/// One prefill server and what discovery learnt about it.
pub struct Prefill {
    /// The server.
    pub backend: Arc<Backend>,
    /// Its bootstrap server, e.g. `http://10.0.0.5:8998`.
    pub bootstrap_addr: Arc<str>,
    /// Woken to make discovery run now (D reported an unknown engine, or P came back).
    pub refresh: Notify,
    /// Discovery metrics.
    pub discovery_metrics: DiscoveryMetrics,
    pairs: Mutex<Vec<Arc<Pair>>>,
    /// engine id -> the model it registered, from the bootstrap server's watch.
    models: Mutex<HashMap<String, Arc<str>>>,
    /// Engine ids marked draining in the registry, from the bootstrap server's watch.
    draining: Mutex<HashSet<String>>,
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
            let marked = draining.contains(&*pair.engine_id);
            if pair.draining.swap(marked, Ordering::Relaxed) != marked {
                tracing::info!(
                    prefill = self.backend.url(),
                    engine_id = &*pair.engine_id,
                    draining = marked,
                    "registry drain mark"
                );
            }
        }
    }

    /// The dp ranks and engine ids currently known, by rank.
    pub fn ranks(&self) -> Vec<(Rank, Arc<str>)> {
        lock(&self.pairs)
            .iter()
            .map(|pair| (pair.dp_rank, pair.engine_id.clone()))
            .collect()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

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
                    bootstrap_addr: Arc::from(target.bootstrap_addr.as_str()),
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
                && &*pair.engine_id == rank.engine_id
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
                                engine_id: Arc::from(rank.engine_id),
                                model: rank.model.map(Arc::from),
                                dp_size: rank.dp_size,
                                outstanding: AtomicUsize::new(0),
                                draining: AtomicBool::new(draining.contains(rank.engine_id)),
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
