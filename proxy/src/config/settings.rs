//! [`Config`]: the validated configuration the proxy runs with, and its parts.

use std::time::Duration;

use pd_service::TlsFiles;

use super::{PrefillTarget, RouterConfig};

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
    /// The fleet and the placement: the router's part.
    pub router: RouterConfig,
    /// Host to listen on.
    pub host: String,
    /// Port to listen on (0 picks a free one).
    pub port: u16,
    /// HTTPS on the serving and admin listeners, when set.
    pub tls: Option<TlsFiles>,
    /// Threads serving clients, each with a runtime, a listener and backend connections of its
    /// own (0: one per CPU).
    pub serving_threads: usize,
    /// Time limit of a whole request, from its arrival, streaming included.
    pub request_timeout: Duration,
    /// Time limit of one request to P.
    pub prefill_timeout: Duration,
    /// Time limit of D's first byte, from P's answer.
    pub decode_first_byte_timeout: Duration,
    /// How answers move to another decode when theirs fails.
    pub migration: MigrationSettings,
    /// Time limit of a TCP connect to any backend.
    pub connect_timeout: Duration,
    /// How long requests in flight may run on once the proxy stops accepting.
    pub shutdown_grace: Duration,
    /// What a client may cost.
    pub clients: ClientLimits,
    /// The key clients must present, if any (the `default` tenant's).
    pub api_key: Option<String>,
    /// The tenants' keys and limits (`--api-keys-file`), if any.
    pub api_keys_file: Option<std::path::PathBuf>,
    /// The key of the admin routes, if they are on.
    pub admin_key: Option<String>,
    /// Where the operator's routes are served on their own (host, port), if they are.
    pub admin_listener: Option<(String, u16)>,
    /// Whether `/metrics` on the serving port needs no key.
    pub metrics_open: bool,
    /// Whether it runs beside a decode as a gateway's sidecar (see `--sidecar`).
    pub sidecar: bool,
}

impl Config {
    /// A configuration with the binary's defaults for everything but the backends, listening on
    /// 127.0.0.1 with an OS-chosen port (handy for tests and benchmarks).
    pub fn new(prefills: Vec<PrefillTarget>, decodes: Vec<String>) -> Self {
        Config {
            router: RouterConfig::new(prefills, decodes),
            host: "127.0.0.1".to_owned(),
            port: 0,
            tls: None,
            serving_threads: 0,
            request_timeout: Duration::from_secs(600),
            prefill_timeout: Duration::from_secs(30),
            decode_first_byte_timeout: Duration::from_secs(60),
            migration: MigrationSettings {
                limit: 2,
                stall: Duration::from_secs(30),
            },
            connect_timeout: Duration::from_secs(5),
            shutdown_grace: Duration::from_secs(30),
            clients: ClientLimits {
                header_read_timeout: Duration::from_secs(10),
                body_read_timeout: Duration::from_secs(30),
                max_body_bytes: 32 << 20,
                body_memory_bytes: 48 << 20,
                max_connections: 4096,
            },
            api_key: None,
            api_keys_file: None,
            admin_key: None,
            admin_listener: None,
            metrics_open: false,
            sidecar: false,
        }
    }
}

/// How answers move to another decode when theirs fails (`--migration-limit`,
/// `--decode-stall-timeout`).
#[derive(Debug, Clone, Copy)]
pub struct MigrationSettings {
    /// At most this many migrations per request (0: none).
    pub limit: u32,
    /// A streaming decode that sends nothing for this long is taken as stalled.
    pub stall: Duration,
}
