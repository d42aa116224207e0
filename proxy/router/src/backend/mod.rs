//! What the proxy knows about each backend: health, load, and for prefills the dp ranks and
//! engine ids discovered on their bootstrap servers.
//!
//! Everything a request reads is an atomic or a snapshot behind a lock held for a pointer copy;
//! no lock is ever held across an await. [`Backend`] is one P or D server (and [`Call`] one call
//! to it), [`ModelCard`] a model it serves, [`Pair`] a prefill's dp rank, [`Prefill`] what
//! discovery learnt of a prefill, and [`Pool`] all of them, one file each; `hold.rs` what a
//! request holds on a backend before or beside its call ([`Reservation`], [`AwaitingPrefill`]).

mod call;
mod card;
mod hold;
mod pair;
mod pool;
mod prefill;
pub mod states;

pub use call::Call;
pub use card::{read_cards, ModelCard};
pub use hold::{AwaitingPrefill, Reservation};
pub use pair::{pair_id, DiscoveredRank, Pair};
pub use pool::Pool;
pub use prefill::Prefill;

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Instant;

use reqwest::Url;
use tokio::sync::Notify;

use crate::config::HealthConfig;
use crate::endpoint::Endpoint;
use crate::metrics::{BackendMetrics, FleetMetrics};
use crate::saturation::{EngineSignals, Saturated, SaturationConfig, Signals};

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
    address: String,
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
    /// `{url}/version`.
    pub version_url: Url,
    healthy: AtomicBool,
    /// The models the backend lists at `/v1/models` (`None` until known).
    models: RwLock<Option<Arc<[ModelCard]>>>,
    /// The version its `/version` reports (`None` until known).
    version: RwLock<Option<Arc<str>>>,
    failures: AtomicU32,
    successes: AtomicU32,
    /// Woken when real traffic took the backend out, so its checks switch to the recovery
    /// interval at once.
    recheck: Notify,
    /// A sign of life was seen on real traffic or a `/metrics` read since the health checker
    /// last asked (see [`Backend::progressed`]).
    alive: AtomicBool,
    outstanding: AtomicUsize,
    /// Requests of this process on it whose prefill still runs (see [`hold`]).
    awaiting_prefill: AtomicUsize,
    /// Drained by an operator at this proxy (`POST /admin/drain`).
    drained: AtomicBool,
    /// Whether its role is its engine's duty now (always, but for an engine serving both
    /// roles: [`crate::duty`]).
    on_duty: AtomicBool,
    /// Requests running and waiting as the engine reports them ([`UNKNOWN`]: not known).
    engine_load: AtomicUsize,
    /// What the engine last reported of its scheduler and cache, and when.
    signals: Signals,
    /// Why it is saturated until its next judgement whatever is sent to it (0: it is not;
    /// see [`Saturated`]).
    saturated: std::sync::atomic::AtomicU8,
    /// From how many requests in flight it is saturated, as last judged.
    saturates_at: AtomicUsize,
    /// Its predicted latencies, learnt from its answers.
    pub latency: crate::latency::model::EngineLatency,
    metrics: BackendMetrics,
}

impl Backend {
    /// A backend at `url` (a base URL without trailing slash), healthy until checks say otherwise.
    pub fn new(role: Role, url: &str, metrics: &FleetMetrics) -> Self {
        let join = |path: &str| {
            Url::parse(&format!("{url}{path}")).expect("a checked base URL plus a path is a URL")
        };
        let metrics = metrics.backend(role.as_str(), url);
        metrics.healthy.set(1);
        let base = join("/");
        let address = format!(
            "{}:{}",
            base.host_str().unwrap_or_default(),
            base.port_or_known_default().unwrap_or(80)
        );
        Backend {
            url: url.to_owned(),
            address,
            id: identity(role, url),
            role,
            completions_url: Endpoint::new(join("/v1/completions")),
            chat_completions_url: Endpoint::new(join("/v1/chat/completions")),
            generate_url: Endpoint::new(join("/generate")),
            models_url: join("/v1/models"),
            health_url: join("/health"),
            metrics_url: join("/metrics"),
            version_url: join("/version"),
            healthy: AtomicBool::new(true),
            models: RwLock::new(None),
            version: RwLock::new(None),
            failures: AtomicU32::new(0),
            successes: AtomicU32::new(0),
            recheck: Notify::new(),
            alive: AtomicBool::new(false),
            outstanding: AtomicUsize::new(0),
            awaiting_prefill: AtomicUsize::new(0),
            drained: AtomicBool::new(false),
            on_duty: AtomicBool::new(true),
            engine_load: AtomicUsize::new(UNKNOWN),
            signals: Signals::default(),
            saturated: std::sync::atomic::AtomicU8::new(0),
            saturates_at: AtomicUsize::new(usize::MAX),
            latency: Default::default(),
            metrics,
        }
    }

    /// The base URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its `host:port` (the port made explicit; an IPv6 host in brackets): how a gateway
    /// names it (`x-gateway-destination-endpoint`, `x-prefiller-host-port`).
    pub fn address(&self) -> &str {
        &self.address
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

    /// What the engine last reported of its scheduler and cache.
    pub fn signals(&self) -> &Signals {
        &self.signals
    }

    /// Records what the engine reported at `at`: its waiting requests less those of this
    /// process that wait for their prefill's KV, not for room.
    pub fn record_signals(&self, mut signals: EngineSignals, at: Instant) {
        let awaiting = self.awaiting_prefill();
        signals.waiting = signals
            .waiting
            .map(|waiting| waiting.saturating_sub(awaiting));
        self.signals.record(signals, at);
    }

    /// Judges whether the engine is saturated now under `config` (its signals, this
    /// process's requests in flight), keeps the judgement for [`Backend::is_saturated`] and
    /// shows the verdict in the metrics.
    pub fn judge_saturation(&self, config: &SaturationConfig, now: Instant) -> Option<Saturated> {
        let in_flight = self.outstanding();
        let judged = self.signals.judge(config, in_flight, now);
        let code = judged.standing.map_or(0, |why| why as u8 + 1);
        self.saturated.store(code, Ordering::Relaxed);
        self.saturates_at
            .store(judged.saturates_at, Ordering::Relaxed);
        let verdict =
            (judged.standing).or((in_flight >= judged.saturates_at).then_some(judged.counted));
        self.metrics.saturated.set(i64::from(verdict.is_some()));
        verdict
    }

    /// Whether the engine is saturated now: by its last judgement, or by the requests sent to
    /// it since (see [`crate::saturation::Signals::judge`]). Two atomic reads.
    pub fn is_saturated(&self) -> bool {
        self.saturated.load(Ordering::Relaxed) != 0
            || self.outstanding() >= self.saturates_at.load(Ordering::Relaxed)
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

    /// Whether its role is its engine's duty now (see [`crate::duty`]).
    pub fn is_on_duty(&self) -> bool {
        self.on_duty.load(Ordering::Relaxed)
    }

    /// Puts its role on its engine's duty, or off it: off duty, no new request picks it in
    /// this role and the calls in flight finish.
    pub(crate) fn set_on_duty(&self, on_duty: bool) {
        self.on_duty.store(on_duty, Ordering::Relaxed);
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

    /// The models the backend serves, as its `/v1/models` listed them (`None`: not known yet).
    pub fn models(&self) -> Option<Arc<[ModelCard]>> {
        self.models
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The engine version the backend reports, once known.
    pub fn version(&self) -> Option<Arc<str>> {
        self.version
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records the engine version the backend reports (none: to be read again).
    pub fn set_version(&self, version: Option<&str>) {
        *self.version.write().unwrap_or_else(PoisonError::into_inner) = version.map(Arc::from);
    }

    /// Records the models the backend serves.
    pub fn set_models(&self, models: Vec<ModelCard>) {
        *self.models.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::from(models));
    }

    /// Adds `card` to the models it serves (an adapter just loaded on it), unless it lists it.
    pub fn add_model(&self, card: ModelCard) {
        let mut models = self.models.write().unwrap_or_else(PoisonError::into_inner);
        let mut list: Vec<ModelCard> = models.as_deref().unwrap_or_default().to_vec();
        if !list.iter().any(|known| known.id == card.id) {
            list.push(card);
        }
        *models = Some(Arc::from(list));
    }

    /// Whether it lists `model` (`None`: its models are not known yet).
    pub fn lists(&self, model: &str) -> Option<bool> {
        let models = self.models.read().unwrap_or_else(PoisonError::into_inner);
        Some(models.as_ref()?.iter().any(|card| card.id == model))
    }

    /// Its card of `model`, if it lists it.
    pub fn card(&self, model: &str) -> Option<ModelCard> {
        let models = self.models.read().unwrap_or_else(PoisonError::into_inner);
        models
            .as_ref()?
            .iter()
            .find(|card| card.id == model)
            .cloned()
    }

    /// The context length (`max_model_len`) on its card of `model` (an adapter's: its base
    /// model's; without a model: its first model's), if the card gives one.
    pub fn context_length(&self, model: Option<&str>) -> Option<u64> {
        let models = self.models.read().unwrap_or_else(PoisonError::into_inner);
        card::context_length(models.as_ref()?, model)
    }

    /// Whether the backend may serve `model`: it lists it, or nothing is known (of the
    /// backend's models, or of the model).
    pub fn serves(&self, model: Option<&str>) -> bool {
        model.is_none_or(|model| self.lists(model) != Some(false))
    }

    /// Whether it may take a request for `model` (when known): healthy, not drained, on its
    /// engine's duty, and serving it.
    pub fn takes_requests(&self, model: Option<&str>) -> bool {
        self.is_healthy() && !self.is_drained() && self.is_on_duty() && self.serves(model)
    }

    /// Calls through this proxy not yet finished.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Whether it is out of rotation or failed its last check: it is then checked at the
    /// recovery interval.
    pub fn is_recovering(&self) -> bool {
        !self.is_healthy() || self.failures.load(Ordering::Relaxed) > 0
    }

    /// Notes a sign of life: an answer of the backend began, a chunk of one arrived, or it
    /// answered a `/metrics` read. Called per streamed chunk, so it writes the shared flag only
    /// when it is not already set (a read of a line every core keeps, not a write to it).
    pub fn progressed(&self) {
        if !self.alive.load(Ordering::Relaxed) {
            self.alive.store(true, Ordering::Relaxed);
        }
    }

    /// Whether a sign of life was seen since the previous call (which clears it): a health
    /// check that runs out of time counts as failed only when none was.
    pub fn take_progress(&self) -> bool {
        self.alive.swap(false, Ordering::Relaxed)
    }

    /// Resolves when real traffic took the backend out (see [`Backend::eject`]).
    pub async fn ejected(&self) {
        self.recheck.notified().await;
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
    /// health checks, at the recovery interval from now on, bring it back after
    /// `--health-success-threshold` passes.
    pub fn eject(&self, why: &str) {
        self.successes.store(0, Ordering::Relaxed);
        self.recheck.notify_one();
        if self.healthy.swap(false, Ordering::Relaxed) {
            self.metrics.healthy.set(0);
            tracing::warn!(backend = %self.url, role = self.role.as_str(), "{why}: backend taken out until it passes health checks");
        }
    }

    /// Marks a backend that just joined and failed its first check out of rotation, quietly:
    /// its health checks bring it in once they pass.
    pub fn start_unproven(&self) {
        self.successes.store(0, Ordering::Relaxed);
        self.set_healthy(false);
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
