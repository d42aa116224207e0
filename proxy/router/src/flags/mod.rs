//! The flags of the fleet and the placement, the same in every front door (each with an
//! environment fallback) and read from the same `--config` file ([`file`]): [`FleetArgs`],
//! flattened into a front door's own flags and validated into a [`RouterConfig`], and
//! [`parse_args`], which reads a command line with its `--config` file.
//!
//! The prefill and decode flags are vLLM's Mooncake proxy's: `--prefill URL [BOOTSTRAP_PORT|none]`
//! (repeatable; `none` or no port means 8998, or no bootstrap server in sequential mode; the
//! bootstrap host is the prefill URL's host; a bootstrap URL instead of the port names a
//! registry elsewhere) and `--decode URL` (repeatable); `targets.rs` checks them.

use std::path::PathBuf;
use std::time::Duration;

mod effective;
mod file;
pub mod headings;
mod parse;

use clap::{ArgAction, Args, Command};
use pd_service::parse_seconds;
use worker_client::ClientTls;

pub use self::file::{ConfigFile, FileError, FileModels};
pub use self::parse::{check_args, parse_args};
pub use crate::admission::settings::AdmissionArgs;
use crate::config::{base_url, parse_backend_url, parse_dns, parse_prefill_entry};
use crate::config::{parse_prefill_env, PrefillEntry, PrefillTarget};
use crate::config::{ConfigError, DiscoveryConfig, DnsConfig, HealthConfig, Mode, RouterConfig};
pub use crate::duty::settings::DutyArgs;
pub use crate::kv_events::config::KvEventsArgs;
pub use crate::models::settings::ModelsArgs;
pub use crate::planner::settings::PlannerArgs;
use crate::routing::settings::Policy;
pub use crate::routing::settings::RoutingArgs;
use crate::saturation::SaturationConfig;

/// The fleet's and the placement's flags.
#[derive(Debug, Args)]
pub struct FleetArgs {
    /// A prefill server: its URL and, optionally, its bootstrap port (`none` or omitted: 8998;
    /// in sequential mode, no bootstrap server) on the URL's host, or its bootstrap server's
    /// own URL (`http://HOST:PORT`: a registry shared by a P deployment's pods). Repeatable.
    /// Without the flag, PD_PROXY_PREFILL is read: comma-separated `URL[ PORT]` entries.
    #[arg(help_heading = headings::BACKENDS, long, num_args = 1..=2, value_names = ["URL", "BOOTSTRAP_PORT"], action = ArgAction::Append)]
    pub prefill: Vec<String>,
    /// The `--prefill` values grouped by occurrence (filled by [`parse_args`]).
    #[arg(skip)]
    pub prefill_groups: Vec<Vec<String>>,
    /// An engine that serves both roles (vLLM with `"kv_role": "kv_both"`, concurrent mode):
    /// its URL and its bootstrap server, as for --prefill. Each is on prefill or decode duty
    /// at a time, the split following the capacity planner. Repeatable.
    #[arg(help_heading = headings::BACKENDS, long, num_args = 1..=2, value_names = ["URL", "BOOTSTRAP_PORT"], action = ArgAction::Append)]
    pub dual: Vec<String>,
    /// The `--dual` values grouped by occurrence (filled by [`parse_args`]).
    #[arg(skip)]
    pub dual_groups: Vec<Vec<String>>,
    /// A decode server's URL. Repeatable (or comma-separated).
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_DECODE", value_delimiter = ',')]
    pub decode: Vec<String>,
    /// How backends are chosen (both choices, unless --prefill-policy or --decode-policy).
    #[arg(help_heading = headings::ROUTING, long, env = "PD_PROXY_POLICY", value_enum, default_value_t = Policy::RoundRobin)]
    pub policy: Policy,
    /// The per-choice policies, their knobs and conditional disaggregation.
    #[command(flatten, next_help_heading = headings::ROUTING)]
    pub routing: RoutingArgs,
    /// Following the engines' KV cache events.
    #[command(flatten, next_help_heading = headings::ROUTING)]
    pub kv_events: KvEventsArgs,
    /// Whether D starts with P (concurrent) or after P answered (sequential, for NIXL), or
    /// SGLang's P/D.
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_MODE", value_enum, default_value_t = Mode::Concurrent)]
    pub mode: Mode,
    /// Seconds between two health checks (`GET /health`) of each backend.
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_HEALTH_CHECK_INTERVAL", default_value = "5", value_parser = parse_seconds)]
    pub health_check_interval: Duration,
    /// Seconds between two health checks of a backend that failed its last one or is out of
    /// rotation, so that a restarted engine is back soon after it answers (at most the
    /// interval).
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_HEALTH_RECOVERY_INTERVAL", default_value = "0.5", value_parser = parse_seconds)]
    pub health_recovery_interval: Duration,
    /// Seconds one health check may take. A check that runs out of time counts as failed only
    /// when the backend also answered nothing since the previous check (a busy engine answers
    /// slowly, a dead one not at all).
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_HEALTH_CHECK_TIMEOUT", default_value = "2", value_parser = parse_seconds)]
    pub health_check_timeout: Duration,
    /// Consecutive failed health checks that mark a backend unhealthy.
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_HEALTH_FAILURE_THRESHOLD", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub health_failure_threshold: u32,
    /// Consecutive passed health checks that mark an unhealthy backend healthy again.
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_HEALTH_SUCCESS_THRESHOLD", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub health_success_threshold: u32,
    /// Seconds between two reads of each backend's `/metrics` for the load its engine reports
    /// (vLLM's and SGLang's requests running and waiting); 0: only this process's counts.
    #[arg(help_heading = headings::OVERLOAD, long, env = "PD_PROXY_ENGINE_METRICS_INTERVAL", default_value = "2", value_parser = parse_interval)]
    pub engine_metrics_interval: Duration,
    /// Requests waiting in an engine's scheduler (vLLM's `vllm:num_requests_waiting`,
    /// SGLang's `sglang:num_queue_reqs`) from which it is saturated; 0: not judged on them.
    #[arg(help_heading = headings::OVERLOAD, long, env = "PD_PROXY_SATURATION_WAITING", default_value_t = 5)]
    pub saturation_waiting: usize,
    /// The share of an engine's KV cache in use (`vllm:kv_cache_usage_perc`,
    /// `sglang:token_usage`) from which it is saturated; 0: not judged on it.
    #[arg(help_heading = headings::OVERLOAD, long, env = "PD_PROXY_SATURATION_KV_USAGE", default_value_t = 0.95)]
    pub saturation_kv_usage: f64,
    /// Requests this process has in flight on an engine from which it is saturated (for
    /// engines without `/metrics`); 0: not judged on them.
    #[arg(help_heading = headings::OVERLOAD, long, env = "PD_PROXY_SATURATION_IN_FLIGHT", default_value_t = 0)]
    pub saturation_in_flight: usize,
    /// Admission under overload and the retry budget.
    #[command(flatten, next_help_heading = headings::OVERLOAD)]
    pub admission: AdmissionArgs,
    /// The capacity planner.
    #[command(flatten, next_help_heading = headings::PLANNER)]
    pub planner: PlannerArgs,
    /// The duties of `--dual` engines.
    #[command(flatten, next_help_heading = headings::PLANNER)]
    pub duty: DutyArgs,
    /// Seconds between two re-discoveries of each prefill's dp ranks and engine ids.
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_DISCOVERY_INTERVAL", default_value = "30", value_parser = parse_seconds)]
    pub discovery_interval: Duration,
    /// The DNS server that resolves `dns://` backends, `IP:PORT` (default: the system's, from
    /// /etc/resolv.conf).
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_DNS_SERVER")]
    pub dns_server: Option<std::net::SocketAddr>,
    /// Seconds between two resolutions of each `dns://` name (sooner when its records' TTL is
    /// shorter, never under 1 s).
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_DNS_INTERVAL", default_value = "5", value_parser = parse_seconds)]
    pub dns_interval: Duration,
    /// CA certificates (PEM) trusted for `https://` engines and bootstrap servers, beside the
    /// system's roots and the bundled Mozilla roots.
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_UPSTREAM_CA")]
    pub upstream_ca: Option<PathBuf>,
    /// Client certificate (PEM) presented to `https://` engines and bootstrap servers that ask
    /// for one (vLLM's `--ssl-cert-reqs 2`, a bootstrap server's `--tls-client-ca`).
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_UPSTREAM_CERT", requires = "upstream_key")]
    pub upstream_cert: Option<PathBuf>,
    /// The private key (PEM) of --upstream-cert.
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_PROXY_UPSTREAM_KEY", requires = "upstream_cert")]
    pub upstream_key: Option<PathBuf>,
    #[command(flatten, next_help_heading = headings::ROUTING)]
    #[allow(missing_docs)]
    pub models: ModelsArgs,
    /// A TOML file of flags (each under its long name; the command line and environment win)
    /// and models' tables: `[aliases]`, `[models."NAME"]` policies, `[adapters.NAME]`, and
    /// `[objectives]` (an objective's name -> its priority).
    #[arg(long, env = "PD_PROXY_CONFIG", help_heading = None::<&str>)]
    pub config: Option<PathBuf>,
    /// The models' tables of `--config`.
    #[arg(skip)]
    pub file_models: FileModels,
}

impl FleetArgs {
    /// The `--dual` engines: each a URL and its bootstrap server, never a `dns://` name.
    fn duals(&self, default_port: Option<u16>) -> Result<Vec<PrefillTarget>, ConfigError> {
        (self.dual_groups.iter())
            .map(|values| {
                let port = values.get(1).map(String::as_str);
                match parse_prefill_entry(&values[0], port, default_port)? {
                    PrefillEntry::Server(target) => Ok(target),
                    PrefillEntry::Dns(_) => Err(ConfigError::Dual(format!(
                        "--dual {}: engines of both roles are given by URL, not dns://",
                        values[0]
                    ))),
                }
            })
            .collect()
    }
}

/// Seconds, where 0 means never.
fn parse_interval(text: &str) -> Result<Duration, String> {
    if text.trim().parse::<f64>() == Ok(0.0) {
        return Ok(Duration::ZERO);
    }
    parse_seconds(text)
}

impl FleetArgs {
    /// Validates the flags into the router's configuration. `prefill_env` is the value of
    /// [`super::PREFILL_ENV`], used only when no `--prefill` flag was given; `prefills_needed`:
    /// a fleet without prefills is refused (pd-proxy; an endpoint picker may front engines
    /// that serve whole requests).
    pub fn into_config(
        self,
        prefill_env: Option<&str>,
        prefills_needed: bool,
    ) -> Result<RouterConfig, ConfigError> {
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
        let duals = self.duals(default_port)?;
        if prefills_needed && prefills.is_empty() && dns_prefills.is_empty() && duals.is_empty() {
            return Err(ConfigError::NoPrefill);
        }
        let (mut decodes, mut dns_decodes) = (Vec::new(), Vec::new());
        for text in self.decode.iter().filter(|text| !text.trim().is_empty()) {
            match parse_dns("--decode", text) {
                Some(target) => dns_decodes.push(target?),
                None => decodes.push(base_url(&parse_backend_url("--decode", text)?)),
            }
        }
        if decodes.is_empty() && dns_decodes.is_empty() && duals.is_empty() {
            return Err(ConfigError::NoDecode);
        }
        let fixed = prefills.len() + dns_prefills.len() + decodes.len() + dns_decodes.len();
        if !duals.is_empty() && duals.len() + fixed < 2 {
            return Err(ConfigError::Dual(
                "one --dual engine alone cannot be its own prefill and decode: give another --dual, --prefill or --decode".into(),
            ));
        }
        if !duals.is_empty() && self.mode != Mode::Concurrent {
            return Err(ConfigError::Dual(format!(
                "--dual needs --mode concurrent (vLLM's Mooncake connector with kv_both), not {:?}",
                self.mode
            )));
        }
        if let Some(on_prefill) = self.duty.dual_prefills.filter(|n| *n > duals.len()) {
            return Err(ConfigError::Dual(format!(
                "--dual-prefills {on_prefill} is more than the {} --dual engines",
                duals.len()
            )));
        }
        let routing = self.routing.config(self.policy);
        let objectives = self.file_models.objectives.clone();
        let models = self.file_models.config(
            routing.prefill_policy,
            routing.decode_policy,
            self.models.lora_load_on_demand,
            self.models.lora_load_timeout,
        );
        let mut config = RouterConfig::new(prefills, decodes);
        config.admission = self.admission.config(objectives);
        config.planner = self.planner.config()?;
        config.duals = duals;
        config.duty = self.duty.config();
        config.routing = routing;
        config.models = models;
        let precise = crate::follows_kv_events(&config);
        config.kv_events = self.kv_events.config(precise);
        if config.routing.decode_only.prefix_share.is_some()
            && !config.routing.decode_policy.knows_prefixes()
        {
            return Err(ConfigError::PrefixShareNeedsCacheAware);
        }
        config.mode = self.mode;
        config.dns = DnsConfig {
            prefills: dns_prefills,
            decodes: dns_decodes,
            server: self.dns_server,
            interval: self.dns_interval,
        };
        config.health = HealthConfig {
            interval: self.health_check_interval,
            recovery_interval: self.health_recovery_interval,
            timeout: self.health_check_timeout,
            failure_threshold: self.health_failure_threshold,
            success_threshold: self.health_success_threshold,
        };
        config.discovery = DiscoveryConfig {
            interval: self.discovery_interval,
            backoff_min: Duration::from_millis(100),
            backoff_max: self.discovery_interval.min(Duration::from_secs(5)),
            timeout: self.health_check_timeout.max(Duration::from_secs(5)),
            sglang: self.mode == Mode::Sglang,
        };
        config.upstream_tls = ClientTls::load(
            self.upstream_ca.as_deref(),
            self.upstream_cert.as_deref(),
            self.upstream_key.as_deref(),
        )
        .map_err(|err| ConfigError::Tls(err.to_string()))?;
        config.engine_metrics_interval =
            Some(self.engine_metrics_interval).filter(|interval| !interval.is_zero());
        config.saturation = SaturationConfig {
            waiting: self.saturation_waiting,
            kv_usage: self.saturation_kv_usage.max(0.0),
            in_flight: self.saturation_in_flight,
            // An engine silent for three reads in a row.
            stale_after: self.engine_metrics_interval * 3,
        };
        Ok(config)
    }
}

/// `command` with every environment fallback named `PD_PROXY_*` renamed `{prefix}*`: the
/// shared flags under another front door's own names.
pub fn with_env_prefix(command: Command, prefix: &str) -> Command {
    command.mut_args(|arg| {
        let renamed = (arg.get_env())
            .and_then(|env| env.to_str())
            .and_then(|env| env.strip_prefix("PD_PROXY_"))
            .map(|rest| format!("{prefix}{rest}"));
        match renamed {
            // clap keeps names as 'static strings; a command is built once per parse.
            Some(name) => arg.env(&*Box::leak(name.into_boxed_str())),
            None => arg,
        }
    })
}
