//! [`Config`]: the validated configuration the proxy runs with, and its parts.

use std::time::Duration;

use super::{
    DiscoveryConfig, DnsConfig, HealthConfig, KvEventsConfig, Mode, ModelsConfig, Policy,
    PrefillTarget, RouterConfig, RoutingConfig,
};

/// What one client may cost the proxy: time to send a request, bytes held while it arrives,
/// connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientLimits {
    /// Time to send a request's headers.
    pub header_read_timeout: Duration,
    /// Time to send a request's whole body.
    pub body_read_timeout: Duration,
    /// The largest body accepted.
    pub max_body_bytes: usize,
    /// Bytes of bodies held at once, across requests.
    pub body_memory_bytes: usize,
    /// Client connections open at once.
    pub max_connections: usize,
}

/// Everything the proxy needs, validated.
#[derive(Debug, Clone)]
pub struct Config {
    /// Host to listen on.
    pub host: String,
    /// Port to listen on (0 picks a free one).
    pub port: u16,
    /// The prefill servers.
    pub prefills: Vec<PrefillTarget>,
    /// The decode servers' base URLs, without trailing slashes.
    pub decodes: Vec<String>,
    /// How backends are chosen, and whether P is used.
    pub routing: RoutingConfig,
    /// Concurrent or sequential P and D.
    pub mode: Mode,
    /// Time limit of a whole request, from its arrival, streaming included.
    pub request_timeout: Duration,
    /// Time limit of one request to P.
    pub prefill_timeout: Duration,
    /// Time limit of D's first byte, from P's answer.
    pub decode_first_byte_timeout: Duration,
    /// Time limit of a TCP connect to any backend.
    pub connect_timeout: Duration,
    /// How long requests in flight may run on once the proxy stops accepting.
    pub shutdown_grace: Duration,
    /// What a client may cost.
    pub clients: ClientLimits,
    /// Health checks.
    pub health: HealthConfig,
    /// Discovery.
    pub discovery: DiscoveryConfig,
    /// How often each backend's `/metrics` is read for its load (none: never).
    pub engine_metrics_interval: Option<Duration>,
    /// The key clients must present, if any.
    pub api_key: Option<String>,
    /// The key of the admin routes, if they are on.
    pub admin_key: Option<String>,
    /// Following the engines' KV cache events (none: off).
    pub kv_events: Option<KvEventsConfig>,
    /// Backends found through DNS names.
    pub dns: DnsConfig,
    /// Aliases, per-model policies, adapters.
    pub models: ModelsConfig,
}

impl Config {
    /// The router's part: the fleet and the placement.
    pub fn router(&self) -> RouterConfig {
        RouterConfig {
            prefills: self.prefills.clone(),
            decodes: self.decodes.clone(),
            dns: self.dns.clone(),
            health: self.health.clone(),
            discovery: self.discovery.clone(),
            engine_metrics_interval: self.engine_metrics_interval,
            routing: self.routing.clone(),
            kv_events: self.kv_events.clone(),
            models: self.models.clone(),
        }
    }

    /// A configuration with the binary's defaults for everything but the backends, listening on
    /// 127.0.0.1 with an OS-chosen port (handy for tests and benchmarks).
    pub fn new(prefills: Vec<PrefillTarget>, decodes: Vec<String>) -> Self {
        Config {
            host: "127.0.0.1".to_owned(),
            port: 0,
            prefills,
            decodes,
            routing: RoutingConfig::with_policy(Policy::RoundRobin),
            mode: Mode::Concurrent,
            request_timeout: Duration::from_secs(600),
            prefill_timeout: Duration::from_secs(30),
            decode_first_byte_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(5),
            shutdown_grace: Duration::from_secs(30),
            clients: ClientLimits {
                header_read_timeout: Duration::from_secs(10),
                body_read_timeout: Duration::from_secs(30),
                max_body_bytes: 32 << 20,
                body_memory_bytes: 48 << 20,
                max_connections: 4096,
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
            api_key: None,
            admin_key: None,
            kv_events: None,
            dns: DnsConfig {
                prefills: Vec::new(),
                decodes: Vec::new(),
                server: None,
                interval: Duration::from_secs(5),
            },
            models: ModelsConfig {
                load_timeout: Duration::from_secs(30),
                ..ModelsConfig::default()
            },
        }
    }
}
