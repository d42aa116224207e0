//! Command-line flags of the `pd-proxy` binary (each with a `PD_PROXY_*` environment fallback) and
//! their validation into a [`Config`]: the fleet's and the placement's flags are the router's
//! ([`FleetArgs`], shared with pd-epp), read with the same `--config FILE` (a TOML file of any
//! flag, and the models' tables); the rest are the front door's: where it listens, its time
//! limits, what a client may cost, its keys.

mod check;
mod settings;

use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, Parser};
use pd_service::{parse_seconds, parse_seconds_or_zero, LogFormat, TlsFiles};

pub use self::check::{check_config, CHECK_CONFIG};
pub use self::settings::{ClientLimits, Config, MigrationSettings};
pub use pd_router::config::*;
pub use pd_router::flags::*;

/// The pd-proxy: an OpenAI-compatible front door that sends each request to a prefill and a
/// decode server at the same time.
#[derive(Debug, Parser)]
#[command(name = "pd-proxy", version, about)]
pub struct Args {
    /// Address (IP or host name) to listen on.
    #[arg(help_heading = headings::LISTEN, long, env = "PD_PROXY_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(help_heading = headings::LISTEN, long, env = "PD_PROXY_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Serve HTTPS with this certificate chain (PEM), on the serving port and --admin-port;
    /// re-read when the file changes. Needs --tls-key.
    #[arg(help_heading = headings::LISTEN, long, env = "PD_PROXY_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(help_heading = headings::LISTEN, long, env = "PD_PROXY_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Threads serving clients, each on a runtime of its own with its own listener on the port
    /// (SO_REUSEPORT: the kernel spreads connections over them) and its own connections to the
    /// engines, so that a request stays on one core from its arrival to its last byte. 0: one
    /// per CPU the process may use.
    #[arg(help_heading = headings::LISTEN, long, env = "PD_PROXY_SERVING_THREADS", default_value_t = 0)]
    pub serving_threads: usize,
    /// The backends, how they are found, checked and chosen.
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Run beside a decode engine behind a gateway whose endpoint picker (pd-epp) chose the
    /// path: the prefill named in `x-prefiller-host-port` (and `x-pd-prefill-dp-rank`), which
    /// must be one of the fleet's, then the local decode (`--decode`); the decode alone when
    /// none is named.
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_SIDECAR")]
    pub sidecar: bool,
    /// Seconds a whole request may take, from its arrival to the end of its answer: P, D,
    /// a retry and the streaming included.
    #[arg(help_heading = headings::LIMITS, long, env = "PD_PROXY_REQUEST_TIMEOUT", default_value = "600", value_parser = parse_seconds)]
    pub request_timeout: Duration,
    /// Seconds D may take to send its first byte once P has answered (its wait for the KV and
    /// its first token); a D that takes longer fails the request with a 504, without a retry.
    /// At most the request timeout.
    #[arg(help_heading = headings::LIMITS, long, env = "PD_PROXY_DECODE_FIRST_BYTE_TIMEOUT", default_value = "60", value_parser = parse_seconds)]
    pub decode_first_byte_timeout: Duration,
    /// Seconds P may take to answer. P only computes the prompt (max_tokens 1), so a P that
    /// takes longer is frozen: the request fails with a 504 naming it, D is cancelled, and P is
    /// taken out until it passes its health checks again. At most the request timeout.
    #[arg(help_heading = headings::LIMITS, long, env = "PD_PROXY_PREFILL_TIMEOUT", default_value = "30", value_parser = parse_seconds)]
    pub prefill_timeout: Duration,
    /// How many times one request's answer may move to another decode when its decode fails:
    /// mid-answer (a streamed answer goes on from the tokens the client has) or after its
    /// prefill answered (placed again with a fresh prefill). 0 turns migration off.
    #[arg(help_heading = headings::LIMITS, long, env = "PD_PROXY_MIGRATION_LIMIT", default_value_t = 2)]
    pub migration_limit: u32,
    /// Seconds a decode streaming an answer may send nothing before it is taken as stalled:
    /// the answer then goes on on another decode (when it can, see --migration-limit).
    #[arg(help_heading = headings::LIMITS, long, env = "PD_PROXY_DECODE_STALL_TIMEOUT", default_value = "30", value_parser = parse_seconds)]
    pub decode_stall_timeout: Duration,
    /// Seconds a client may take to send a request's headers (also while idle between
    /// keep-alive requests) before its connection is closed.
    #[arg(help_heading = headings::LIMITS, long, env = "PD_PROXY_HEADER_READ_TIMEOUT", default_value = "10", value_parser = parse_seconds)]
    pub header_read_timeout: Duration,
    /// Seconds a client may take to send a request's whole body; a slower or stalled body gets
    /// a 408.
    #[arg(help_heading = headings::LIMITS, long, env = "PD_PROXY_BODY_READ_TIMEOUT", default_value = "30", value_parser = parse_seconds)]
    pub body_read_timeout: Duration,
    /// The largest request body accepted, in bytes (413 above it).
    #[arg(help_heading = headings::LIMITS, long, env = "PD_PROXY_MAX_BODY_BYTES", default_value_t = 32 << 20, value_parser = clap::value_parser!(usize))]
    pub max_body_bytes: usize,
    /// Bytes of request bodies held at once while they arrive, across all requests; a body that
    /// cannot get room before its read timeout gets a 408. Bounds the memory slow clients cost.
    #[arg(help_heading = headings::LIMITS, long, env = "PD_PROXY_BODY_MEMORY_BYTES", default_value_t = 48 << 20, value_parser = clap::value_parser!(usize))]
    pub body_memory_bytes: usize,
    /// The most client connections open at once; more wait to be accepted.
    #[arg(help_heading = headings::LIMITS, long, env = "PD_PROXY_MAX_CONNECTIONS", default_value_t = 4096, value_parser = clap::value_parser!(usize))]
    pub max_connections: usize,
    /// Seconds to wait for a TCP connection to any backend.
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_CONNECT_TIMEOUT", default_value = "5", value_parser = parse_seconds)]
    pub connect_timeout: Duration,
    /// Key clients must send as `Authorization: Bearer <key>` on the /v1 routes: the key of
    /// the tenant `default` (beside the tenants of --api-keys-file).
    #[arg(help_heading = headings::ADMIN, long, env = "PD_PROXY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Tenants, their API keys and their limits (requests per second, prompt and output tokens
    /// per minute, requests in flight): TOML, or JSON for a `.json` name. Re-read when it
    /// changes. A request must then carry one of its keys (or --api-key).
    #[arg(help_heading = headings::ADMIN, long, env = "PD_PROXY_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Key an operator must send as `Authorization: Bearer <key>` to drain backends
    /// (`POST /admin/drain`) and read the KV index; without it those routes are off. While any
    /// key is set and there is no --admin-port, every operator's route on the serving port
    /// (`/metrics`, `/admin/*`, `/ui`) needs it.
    #[arg(help_heading = headings::ADMIN, long, env = "PD_PROXY_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Serve the operator's routes (`/metrics`, `/admin/*`, `/ui`, and `/health`, `/ready`) on a
    /// listener of their own, on this port (0: any free one): the serving port then answers them
    /// with 404.
    #[arg(help_heading = headings::ADMIN, long, env = "PD_PROXY_ADMIN_PORT")]
    pub admin_port: Option<u16>,
    /// Address of the --admin-port listener.
    #[arg(help_heading = headings::ADMIN, long, env = "PD_PROXY_ADMIN_HOST", default_value = "127.0.0.1")]
    pub admin_host: String,
    /// Leave `GET /metrics` on the serving port open to scrapers that send no key, while keys are
    /// set (the other operator's routes still need the admin key).
    #[arg(help_heading = headings::ADMIN, long, env = "PD_PROXY_METRICS_OPEN")]
    pub metrics_open: bool,
    /// Log format.
    #[arg(help_heading = headings::OBSERVABILITY, long, env = "PD_PROXY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Seconds between the first SIGTERM/SIGINT and the end of accepting: `/ready` answers 503
    /// meanwhile, everything else is served as usual (so that Kubernetes takes the pod out of
    /// its endpoints first). A second signal ends it early.
    #[arg(help_heading = headings::LIMITS, long, env = "PD_PROXY_SHUTDOWN_DELAY", default_value = "0", value_parser = parse_seconds_or_zero)]
    pub shutdown_delay: Duration,
    /// Seconds the requests in flight (streams included) when the proxy stops accepting may run
    /// on before their connections are closed.
    #[arg(help_heading = headings::LIMITS, long, env = "PD_PROXY_SHUTDOWN_GRACE", default_value = "30", value_parser = parse_seconds_or_zero)]
    pub shutdown_grace: Duration,
}

impl Args {
    /// Parses a command line (with the flags of its `--config` file, the command line's
    /// winning).
    pub fn try_parse_args<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        parse_args(argv, Args::command, |args: &mut Args| &mut args.fleet)
    }

    /// [`Args::try_parse_args`], and the effective configuration as a sectioned TOML file
    /// (`check-config`).
    pub fn try_check_args<I, T>(argv: I) -> Result<(Self, String), clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        check_args(argv, Args::command, |args: &mut Args| &mut args.fleet)
    }

    /// Parses the process's command line, exiting with clap's message on an error.
    pub fn parse_args() -> Self {
        Self::try_parse_args(std::env::args_os()).unwrap_or_else(|err| err.exit())
    }

    /// Validates the flags into a configuration. `prefill_env` is the value of [`PREFILL_ENV`],
    /// used only when no `--prefill` flag was given.
    pub fn into_config(self, prefill_env: Option<&str>) -> Result<Config, ConfigError> {
        let mut config = Config::new(Vec::new(), Vec::new());
        config.router = self.fleet.into_config(prefill_env, true)?;
        config.host = self.host;
        config.port = self.port;
        config.serving_threads = self.serving_threads;
        config.tls = (self.tls_cert.zip(self.tls_key)).map(|(cert, key)| TlsFiles {
            cert,
            key,
            client_ca: None,
        });
        config.request_timeout = self.request_timeout;
        config.prefill_timeout = self.prefill_timeout.min(self.request_timeout);
        config.decode_first_byte_timeout = self.decode_first_byte_timeout.min(self.request_timeout);
        config.migration = MigrationSettings {
            limit: self.migration_limit,
            stall: self.decode_stall_timeout,
        };
        config.clients = ClientLimits {
            header_read_timeout: self.header_read_timeout,
            body_read_timeout: self.body_read_timeout,
            max_body_bytes: self.max_body_bytes,
            body_memory_bytes: self.body_memory_bytes.max(self.max_body_bytes),
            max_connections: self.max_connections.max(1),
        };
        config.connect_timeout = self.connect_timeout;
        config.shutdown_grace = self.shutdown_grace;
        // An empty key would be "no key"; treat it so rather than demanding `Bearer `.
        config.api_key = self.api_key.filter(|key| !key.is_empty());
        config.api_keys_file = self.api_keys_file;
        config.admin_key = self.admin_key.filter(|key| !key.is_empty());
        config.admin_listener = self.admin_port.map(|port| (self.admin_host, port));
        config.metrics_open = self.metrics_open;
        config.sidecar = self.sidecar;
        Ok(config)
    }
}

#[cfg(test)]
mod tests;
