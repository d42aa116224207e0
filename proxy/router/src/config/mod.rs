//! The fleet's and the placement's settings, plain data: where the backends are (`--prefill`,
//! `--decode`, `dns://` names; `targets.rs`), how they are called ([`Mode`]), checked and
//! discovered, and why a set of flags cannot make a configuration ([`ConfigError`]). The front
//! doors' flags ([`crate::flags`]) are validated into these.

mod targets;

use std::time::Duration;

use crate::duty::DutyConfig;
use crate::planner::PlannerConfig;
use clap::ValueEnum;
use worker_client::ClientTls;

pub use self::targets::{
    base_url, parse_backend_url, parse_dns, parse_prefill, parse_prefill_entry, parse_prefill_env,
    DnsBootstrap, DnsTarget, PrefillEntry, PrefillTarget, DEFAULT_BOOTSTRAP_PORT, PREFILL_ENV,
};
pub use crate::admission::settings::AdmissionConfig;
pub use crate::kv_events::config::KvEventsConfig;
pub use crate::models::settings::{AdapterSource, ModelPolicies, ModelsConfig};
pub use crate::routing::settings::{Fallback, Policy, RoutingConfig};
pub use crate::saturation::SaturationConfig;

/// How P and D are called, which also says how prefills are discovered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Mode {
    /// Send to P and D at the same time (Mooncake connector): D pulls the KV through the
    /// bootstrap server as soon as P has it.
    #[default]
    Concurrent,
    /// Await P's answer and hand the `kv_transfer_params` it returns to D (NIXL connector).
    Sequential,
    /// SGLang's P/D: the same body to P and D at the same time, with `bootstrap_host`,
    /// `bootstrap_port` and `bootstrap_room` added; prefills are discovered through their
    /// bootstrap server's `GET /route`.
    Sglang,
}

impl Mode {
    /// The bootstrap port of a `--prefill` given without one (or with `none`): vLLM's 8998 where
    /// D finds P's KV through a bootstrap server; none in sequential mode, where D gets what P
    /// answered and a NIXL prefill runs no bootstrap server.
    pub fn default_bootstrap_port(self) -> Option<u16> {
        match self {
            Mode::Sequential => None,
            Mode::Concurrent | Mode::Sglang => Some(DEFAULT_BOOTSTRAP_PORT),
        }
    }
}

/// Backends found through DNS names (`dns://` in `--prefill` and `--decode`).
#[derive(Debug, Clone)]
pub struct DnsConfig {
    /// The prefills' names.
    pub prefills: Vec<DnsTarget>,
    /// The decodes' names.
    pub decodes: Vec<DnsTarget>,
    /// The DNS server (none: the system's).
    pub server: Option<std::net::SocketAddr>,
    /// The longest time between two resolutions of a name.
    pub interval: Duration,
}

/// Active health checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthConfig {
    /// Time between two checks of one backend.
    pub interval: Duration,
    /// Time between two checks of a backend that failed its last one or is out of rotation
    /// (used up to `interval`).
    pub recovery_interval: Duration,
    /// How long one check may take.
    pub timeout: Duration,
    /// Consecutive failures that mark a backend unhealthy.
    pub failure_threshold: u32,
    /// Consecutive successes that mark it healthy again.
    pub success_threshold: u32,
}

impl HealthConfig {
    /// The time between two checks of a backend that failed its last one or is out of
    /// rotation: the recovery interval, up to the interval.
    pub fn recovery(&self) -> Duration {
        self.recovery_interval.min(self.interval)
    }
}

/// How each prefill's dp ranks are (re)discovered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryConfig {
    /// Time between two discoveries once one succeeded.
    pub interval: Duration,
    /// First backoff step after a failed discovery (doubling; each pause is drawn between half
    /// and all of its step), and the least time between two discoveries.
    pub backoff_min: Duration,
    /// The largest step: no retry waits longer, jitter included.
    pub backoff_max: Duration,
    /// How long one `/health` or `/query` call may take.
    pub timeout: Duration,
    /// Discover SGLang prefills (`GET /route`) instead of vLLM's (`GET /query`).
    pub sglang: bool,
}

/// Why the flags cannot make a configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A `--planner-*` flag is wrong or missing.
    #[error("{0}")]
    Planner(String),
    /// `--dual` engines that cannot work as given.
    #[error("{0}")]
    Dual(String),
    /// No prefill server was given.
    #[error("no prefill server: pass --prefill URL [BOOTSTRAP_PORT] at least once (or set {PREFILL_ENV})")]
    NoPrefill,
    /// A TLS file of --upstream-ca, --upstream-cert or --upstream-key cannot be used.
    #[error("{0}")]
    Tls(String),
    /// No decode server was given.
    #[error("no decode server: pass --decode URL at least once (or set PD_PROXY_DECODE)")]
    NoDecode,
    /// A URL is not an absolute http(s) URL.
    #[error("invalid {flag} URL {url:?}: {reason}")]
    BadUrl {
        /// `--prefill` or `--decode`.
        flag: &'static str,
        /// The text given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A bootstrap port is neither `none` nor an integer in 1..=65535.
    #[error("Invalid bootstrap port {port:?} for prefill {url}: expected an integer in 1..=65535, `none` or the bootstrap server's http(s) URL")]
    BadBootstrapPort {
        /// The prefill URL it follows.
        url: String,
        /// The text given.
        port: String,
    },
    /// `--decode-only-prefix-share` without a cache-aware decode policy to measure it.
    #[error("--decode-only-prefix-share needs --decode-policy cache_aware or precise_prefix (only they know what each decode holds)")]
    PrefixShareNeedsCacheAware,
    /// An entry of the prefill environment variable has more than two words.
    #[error("invalid {PREFILL_ENV} entry {0:?}: expected `URL` or `URL BOOTSTRAP_PORT`")]
    BadPrefillEntry(String),
}

/// Everything the router needs: the fleet (where the backends are, how they are checked,
/// discovered and measured) and the placement (policies, KV cache events, models).
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// How P and D are called (how prefills are discovered, their default bootstrap port).
    pub mode: Mode,
    /// The prefill servers.
    pub prefills: Vec<PrefillTarget>,
    /// The decode servers' base URLs, without trailing slashes.
    pub decodes: Vec<String>,
    /// Backends found through DNS names.
    pub dns: DnsConfig,
    /// Health checks.
    pub health: HealthConfig,
    /// Discovery of the prefills' dp ranks.
    pub discovery: DiscoveryConfig,
    /// How often each backend's `/metrics` is read for its load (none: never).
    pub engine_metrics_interval: Option<Duration>,
    /// What makes an engine saturated.
    pub saturation: SaturationConfig,
    /// Admission under overload, and the retry budget.
    pub admission: AdmissionConfig,
    /// How backends are chosen, and whether P is used.
    pub routing: RoutingConfig,
    /// Following the engines' KV cache events (none: off unless a policy needs them).
    pub kv_events: Option<KvEventsConfig>,
    /// Aliases, per-model policies, adapters.
    pub models: ModelsConfig,
    /// The CA bundle and client certificate of calls to `https://` engines and registries.
    pub upstream_tls: ClientTls,
    /// The capacity planner (none: off).
    pub planner: Option<PlannerConfig>,
    /// Engines that serve both roles (`--dual`: vLLM `kv_both`), each with its bootstrap
    /// server.
    pub duals: Vec<PrefillTarget>,
    /// How their duties are set.
    pub duty: DutyConfig,
}

impl RouterConfig {
    /// A configuration with the flags' defaults for everything but the backends.
    pub fn new(prefills: Vec<PrefillTarget>, decodes: Vec<String>) -> Self {
        RouterConfig {
            mode: Mode::Concurrent,
            prefills,
            decodes,
            dns: DnsConfig {
                prefills: Vec::new(),
                decodes: Vec::new(),
                server: None,
                interval: Duration::from_secs(5),
            },
            health: HealthConfig {
                interval: Duration::from_secs(5),
                recovery_interval: Duration::from_millis(500),
                timeout: Duration::from_secs(2),
                failure_threshold: 3,
                success_threshold: 2,
            },
            discovery: DiscoveryConfig {
                interval: Duration::from_secs(30),
                backoff_min: Duration::from_millis(100),
                backoff_max: Duration::from_secs(5),
                timeout: Duration::from_secs(5),
                sglang: false,
            },
            engine_metrics_interval: Some(Duration::from_secs(2)),
            saturation: SaturationConfig::default(),
            admission: AdmissionConfig::default(),
            routing: RoutingConfig::with_policy(Policy::RoundRobin),
            kv_events: None,
            models: ModelsConfig {
                load_timeout: Duration::from_secs(30),
                ..ModelsConfig::default()
            },
            upstream_tls: ClientTls::default(),
            planner: None,
            duals: Vec::new(),
            duty: DutyConfig::default(),
        }
    }
}
