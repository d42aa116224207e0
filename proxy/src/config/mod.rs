//! Command-line flags of the `pd-proxy` binary (each with a `PD_PROXY_*` environment fallback) and
//! their validation into a [`Config`].
//!
//! The prefill and decode flags are vLLM's Mooncake proxy's: `--prefill URL [BOOTSTRAP_PORT|none]`
//! (repeatable; `none` or no port means 8998, or no bootstrap server in sequential mode; the
//! bootstrap host is the prefill URL's host; a bootstrap URL instead of the port names a
//! registry elsewhere) and `--decode URL` (repeatable); `targets.rs` checks them. `--config FILE` reads any flag, and the models' tables, from a TOML file
//! (`file.rs`).

mod file;
mod settings;

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, CommandFactory, FromArgMatches, Parser, ValueEnum};
use pd_service::{parse_seconds, parse_seconds_or_zero, LogFormat};

pub use self::file::{ConfigFile, FileError, FileModels};
pub use self::settings::{ClientLimits, Config};
pub use pd_router::config::*;

/// How P and D are called.
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

/// The pd-proxy: an OpenAI-compatible front door that sends each request to a prefill and a
/// decode server at the same time.
#[derive(Debug, Parser)]
#[command(name = "pd-proxy", version, about)]
pub struct Args {
    /// Address (IP or host name) to listen on.
    #[arg(long, env = "PD_PROXY_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, env = "PD_PROXY_PORT", default_value_t = 8000)]
    pub port: u16,
    /// A prefill server: its URL and, optionally, its bootstrap port (`none` or omitted: 8998;
    /// in sequential mode, no bootstrap server) on the URL's host, or its bootstrap server's
    /// own URL (`http://HOST:PORT`: a registry shared by a P deployment's pods). Repeatable. Without the flag, PD_PROXY_PREFILL
    /// is read: comma-separated `URL[ PORT]` entries.
    #[arg(long, num_args = 1..=2, value_names = ["URL", "BOOTSTRAP_PORT"], action = ArgAction::Append)]
    pub prefill: Vec<String>,
    /// The `--prefill` values grouped by occurrence (filled by [`Args::parse_from`]).
    #[arg(skip)]
    pub prefill_groups: Vec<Vec<String>>,
    /// A decode server's URL. Repeatable (or comma-separated).
    #[arg(long, env = "PD_PROXY_DECODE", value_delimiter = ',')]
    pub decode: Vec<String>,
    /// How backends are chosen (both choices, unless --prefill-policy or --decode-policy).
    #[arg(long, env = "PD_PROXY_POLICY", value_enum, default_value_t = Policy::RoundRobin)]
    pub policy: Policy,
    /// The per-choice policies, their knobs and conditional disaggregation.
    #[command(flatten)]
    pub routing: RoutingArgs,
    /// Following the engines' KV cache events.
    #[command(flatten)]
    pub kv_events: KvEventsArgs,
    /// Whether D starts with P (concurrent) or after P answered (sequential, for NIXL).
    #[arg(long, env = "PD_PROXY_MODE", value_enum, default_value_t = Mode::Concurrent)]
    pub mode: Mode,
    /// Seconds a whole request may take, from its arrival to the end of its answer: P, D,
    /// a retry and the streaming included.
    #[arg(long, env = "PD_PROXY_REQUEST_TIMEOUT", default_value = "600", value_parser = parse_seconds)]
    pub request_timeout: Duration,
    /// Seconds D may take to send its first byte once P has answered (its wait for the KV and
    /// its first token); a D that takes longer fails the request with a 504, without a retry.
    /// At most the request timeout.
    #[arg(long, env = "PD_PROXY_DECODE_FIRST_BYTE_TIMEOUT", default_value = "60", value_parser = parse_seconds)]
    pub decode_first_byte_timeout: Duration,
    /// Seconds P may take to answer. P only computes the prompt (max_tokens 1), so a P that
    /// takes longer is frozen: the request fails with a 504 naming it, D is cancelled, and P is
    /// taken out until it passes its health checks again. At most the request timeout.
    #[arg(long, env = "PD_PROXY_PREFILL_TIMEOUT", default_value = "30", value_parser = parse_seconds)]
    pub prefill_timeout: Duration,
    /// Seconds a client may take to send a request's headers (also while idle between
    /// keep-alive requests) before its connection is closed.
    #[arg(long, env = "PD_PROXY_HEADER_READ_TIMEOUT", default_value = "10", value_parser = parse_seconds)]
    pub header_read_timeout: Duration,
    /// Seconds a client may take to send a request's whole body; a slower or stalled body gets
    /// a 408.
    #[arg(long, env = "PD_PROXY_BODY_READ_TIMEOUT", default_value = "30", value_parser = parse_seconds)]
    pub body_read_timeout: Duration,
    /// The largest request body accepted, in bytes (413 above it).
    #[arg(long, env = "PD_PROXY_MAX_BODY_BYTES", default_value_t = 32 << 20, value_parser = clap::value_parser!(usize))]
    pub max_body_bytes: usize,
    /// Bytes of request bodies held at once while they arrive, across all requests; a body that
    /// cannot get room before its read timeout gets a 408. Bounds the memory slow clients cost.
    #[arg(long, env = "PD_PROXY_BODY_MEMORY_BYTES", default_value_t = 48 << 20, value_parser = clap::value_parser!(usize))]
    pub body_memory_bytes: usize,
    /// The most client connections open at once; more wait to be accepted.
    #[arg(long, env = "PD_PROXY_MAX_CONNECTIONS", default_value_t = 4096, value_parser = clap::value_parser!(usize))]
    pub max_connections: usize,
    /// Seconds to wait for a TCP connection to any backend.
    #[arg(long, env = "PD_PROXY_CONNECT_TIMEOUT", default_value = "5", value_parser = parse_seconds)]
    pub connect_timeout: Duration,
    /// Seconds between two health checks (`GET /health`) of each backend.
    #[arg(long, env = "PD_PROXY_HEALTH_CHECK_INTERVAL", default_value = "5", value_parser = parse_seconds)]
    pub health_check_interval: Duration,
    /// Seconds between two health checks of a backend that failed its last one or is out of
    /// rotation, so that a restarted engine is back soon after it answers (at most the
    /// interval).
    #[arg(long, env = "PD_PROXY_HEALTH_RECOVERY_INTERVAL", default_value = "0.5", value_parser = parse_seconds)]
    pub health_recovery_interval: Duration,
    /// Seconds one health check may take. A check that runs out of time counts as failed only
    /// when the backend also answered nothing since the previous check (a busy engine answers
    /// slowly, a dead one not at all).
    #[arg(long, env = "PD_PROXY_HEALTH_CHECK_TIMEOUT", default_value = "2", value_parser = parse_seconds)]
    pub health_check_timeout: Duration,
    /// Consecutive failed health checks that mark a backend unhealthy.
    #[arg(long, env = "PD_PROXY_HEALTH_FAILURE_THRESHOLD", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub health_failure_threshold: u32,
    /// Consecutive passed health checks that mark an unhealthy backend healthy again.
    #[arg(long, env = "PD_PROXY_HEALTH_SUCCESS_THRESHOLD", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub health_success_threshold: u32,
    /// Seconds between two reads of each backend's `/metrics` for the load its engine reports
    /// (vLLM's and SGLang's requests running and waiting); 0: only this proxy's counts.
    #[arg(long, env = "PD_PROXY_ENGINE_METRICS_INTERVAL", default_value = "2", value_parser = parse_interval)]
    pub engine_metrics_interval: Duration,
    /// Seconds between two re-discoveries of each prefill's dp ranks and engine ids.
    #[arg(long, env = "PD_PROXY_DISCOVERY_INTERVAL", default_value = "30", value_parser = parse_seconds)]
    pub discovery_interval: Duration,
    /// Key clients must send as `Authorization: Bearer <key>` on the /v1 routes.
    #[arg(long, env = "PD_PROXY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Key an operator must send as `Authorization: Bearer <key>` to drain backends
    /// (`POST /admin/drain`); without it that route is off.
    #[arg(long, env = "PD_PROXY_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Log format.
    #[arg(long, env = "PD_PROXY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Seconds between the first SIGTERM/SIGINT and the end of accepting: `/ready` answers 503
    /// meanwhile, everything else is served as usual (so that Kubernetes takes the pod out of
    /// its endpoints first). A second signal ends it early.
    #[arg(long, env = "PD_PROXY_SHUTDOWN_DELAY", default_value = "0", value_parser = parse_seconds_or_zero)]
    pub shutdown_delay: Duration,
    /// Seconds the requests in flight (streams included) when the proxy stops accepting may run
    /// on before their connections are closed.
    #[arg(long, env = "PD_PROXY_SHUTDOWN_GRACE", default_value = "30", value_parser = parse_seconds_or_zero)]
    pub shutdown_grace: Duration,
    /// The DNS server that resolves `dns://` backends, `IP:PORT` (default: the system's, from
    /// /etc/resolv.conf).
    #[arg(long, env = "PD_PROXY_DNS_SERVER")]
    pub dns_server: Option<std::net::SocketAddr>,
    /// Seconds between two resolutions of each `dns://` name (sooner when its records' TTL is
    /// shorter, never under 1 s).
    #[arg(long, env = "PD_PROXY_DNS_INTERVAL", default_value = "5", value_parser = parse_seconds)]
    pub dns_interval: Duration,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub models: ModelsArgs,
    /// A TOML file of flags (each under its long name; the command line and environment win)
    /// and models' tables: `[aliases]`, `[models."NAME"]` policies, `[adapters.NAME]`.
    #[arg(long, env = "PD_PROXY_CONFIG")]
    pub config: Option<PathBuf>,
    /// The models' tables of `--config`.
    #[arg(skip)]
    pub file_models: FileModels,
}

/// Seconds, where 0 means never.
fn parse_interval(text: &str) -> Result<Duration, String> {
    if text.trim().parse::<f64>() == Ok(0.0) {
        return Ok(Duration::ZERO);
    }
    parse_seconds(text)
}

impl Args {
    /// Parses a command line (with the flags of its `--config` file, the command line's
    /// winning), keeping each `--prefill` occurrence's one or two values together (clap's
    /// derive flattens them).
    pub fn try_parse_args<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let argv: Vec<std::ffi::OsString> = argv.into_iter().map(Into::into).collect();
        let mut command = Self::command();
        let mut matches = command.try_get_matches_from_mut(&argv)?;
        let mut file_models = FileModels::default();
        if let Some(path) = matches.get_one::<PathBuf>("config").cloned() {
            let invalid = |message: String| {
                Self::command().error(clap::error::ErrorKind::InvalidValue, message)
            };
            let file = ConfigFile::read(&path, &command, &matches)
                .map_err(|err| invalid(err.to_string()))?;
            let (program, rest) = argv.split_first().expect("argv holds the program");
            let combined = std::iter::once(program.clone())
                .chain(file.words)
                .chain(rest.iter().cloned());
            matches = Self::command()
                .try_get_matches_from(combined)
                .map_err(|err| {
                    let flag = err.get(clap::error::ContextKind::InvalidArg).map(|arg| {
                        let text = arg.to_string();
                        let long = text.trim_start_matches("--");
                        long.split([' ', '=']).next().unwrap_or("").to_owned()
                    });
                    match flag.and_then(|flag| file.lines.get(&flag)) {
                        Some(line) => invalid(format!("{}:{line}: {err}", path.display())),
                        None => err,
                    }
                })?;
            file_models = file.models;
        }
        let mut args = Self::from_arg_matches(&matches)?;
        args.file_models = file_models;
        args.prefill_groups = matches
            .get_occurrences::<String>("prefill")
            .map(|occurrences| {
                occurrences
                    .map(|values| values.cloned().collect())
                    .collect()
            })
            .unwrap_or_default();
        Ok(args)
    }

    /// Parses the process's command line, exiting with clap's message on an error.
    pub fn parse_args() -> Self {
        Self::try_parse_args(std::env::args_os()).unwrap_or_else(|err| err.exit())
    }

    /// Validates the flags into a configuration. `prefill_env` is the value of [`PREFILL_ENV`],
    /// used only when no `--prefill` flag was given.
    pub fn into_config(self, prefill_env: Option<&str>) -> Result<Config, ConfigError> {
        let default_port = self.mode.default_bootstrap_port();
        let entries = if self.prefill_groups.is_empty() {
            parse_prefill_env(prefill_env.unwrap_or(""), default_port)?
        } else {
            self.prefill_groups
                .iter()
                .map(|values| {
                    let port = values.get(1).map(String::as_str);
                    parse_prefill_entry(&values[0], port, default_port)
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        let (mut prefills, mut dns_prefills) = (Vec::new(), Vec::new());
        for entry in entries {
            match entry {
                PrefillEntry::Server(target) => prefills.push(target),
                PrefillEntry::Dns(target) => dns_prefills.push(target),
            }
        }
        if prefills.is_empty() && dns_prefills.is_empty() {
            return Err(ConfigError::NoPrefill);
        }
        let (mut decodes, mut dns_decodes) = (Vec::new(), Vec::new());
        for text in self.decode.iter().filter(|text| !text.trim().is_empty()) {
            match parse_dns("--decode", text) {
                Some(target) => dns_decodes.push(target?),
                None => decodes.push(base_url(&parse_backend_url("--decode", text)?)),
            }
        }
        if decodes.is_empty() && dns_decodes.is_empty() {
            return Err(ConfigError::NoDecode);
        }
        let mut config = Config::new(prefills, decodes);
        config.dns = DnsConfig {
            prefills: dns_prefills,
            decodes: dns_decodes,
            server: self.dns_server,
            interval: self.dns_interval,
        };
        config.host = self.host;
        config.port = self.port;
        config.routing = self.routing.config(self.policy);
        config.models = self.file_models.config(
            config.routing.prefill_policy,
            config.routing.decode_policy,
            self.models.lora_load_on_demand,
            self.models.lora_load_timeout,
        );
        let per_model = config.models.policies.values();
        let precise = [config.routing.prefill_policy, config.routing.decode_policy]
            .into_iter()
            .chain(per_model.flat_map(|p| [p.prefill, p.decode]))
            .any(|policy| policy.follows_kv_events());
        config.kv_events = self.kv_events.config(precise);
        if config.routing.decode_only.prefix_share.is_some()
            && !config.routing.decode_policy.knows_prefixes()
        {
            return Err(ConfigError::PrefixShareNeedsCacheAware);
        }
        config.mode = self.mode;
        config.request_timeout = self.request_timeout;
        config.prefill_timeout = self.prefill_timeout.min(self.request_timeout);
        config.decode_first_byte_timeout = self.decode_first_byte_timeout.min(self.request_timeout);
        config.clients = ClientLimits {
            header_read_timeout: self.header_read_timeout,
            body_read_timeout: self.body_read_timeout,
            max_body_bytes: self.max_body_bytes,
            body_memory_bytes: self.body_memory_bytes.max(self.max_body_bytes),
            max_connections: self.max_connections.max(1),
        };
        config.connect_timeout = self.connect_timeout;
        config.shutdown_grace = self.shutdown_grace;
        config.health = HealthConfig {
            interval: self.health_check_interval,
            recovery_interval: self.health_recovery_interval,
            timeout: self.health_check_timeout,
            failure_threshold: self.health_failure_threshold,
            success_threshold: self.health_success_threshold,
        };
        config.discovery.interval = self.discovery_interval;
        config.engine_metrics_interval =
            Some(self.engine_metrics_interval).filter(|interval| !interval.is_zero());
        config.discovery.sglang = self.mode == Mode::Sglang;
        config.discovery.backoff_max = self.discovery_interval.min(Duration::from_secs(5));
        config.discovery.timeout = self.health_check_timeout.max(Duration::from_secs(5));
        // An empty key would be "no key"; treat it so rather than demanding `Bearer `.
        config.api_key = self.api_key.filter(|key| !key.is_empty());
        config.admin_key = self.admin_key.filter(|key| !key.is_empty());
        Ok(config)
    }
}

#[cfg(test)]
mod tests;
