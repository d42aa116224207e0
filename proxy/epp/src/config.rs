//! pd-epp's flags: where it listens (ext_proc and gRPC health on `--port`, metrics, HTTP
//! health and the admin routes on `--admin-port`), with TLS or not, what a request may cost, its key, and the fleet's and the
//! placement's flags, the same as pd-proxy's ([`FleetArgs`], with `PD_EPP_*` environment
//! fallbacks) and the same `--config` file.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, Parser};
use pd_router::backend::Backend;
use pd_router::config::{ConfigError, RouterConfig};
use pd_router::flags::{headings, parse_args, with_env_prefix, FleetArgs};
use pd_service::{parse_seconds_or_zero, LogFormat, TlsFiles};

/// The admin listener's port when none is given.
pub const DEFAULT_ADMIN_PORT: u16 = 9090;

/// The prefills when no `--prefill` flag is given: comma-separated `URL[ PORT]` entries.
pub const PREFILL_ENV: &str = "PD_EPP_PREFILL";

/// pd-epp: the Gateway API Inference Extension's endpoint picker for Envoy (ext_proc), placing
/// each request with pd-bootstrap's routing.
#[derive(Debug, Parser)]
#[command(name = "pd-epp", version, about)]
pub struct Args {
    /// Address (IP or host name) to listen on.
    #[arg(help_heading = headings::LISTEN, long, env = "PD_EPP_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port of the ext_proc service (and the gRPC health service beside it).
    #[arg(help_heading = headings::LISTEN, long, env = "PD_EPP_PORT", default_value_t = 9002)]
    pub port: u16,
    /// Port of the operator's HTTP listener: `GET /metrics`, `/health`, `/ready` and the
    /// admin routes (`--metrics-port` and PD_EPP_METRICS_PORT are the older names); 9090 when
    /// not given.
    #[arg(
        help_heading = headings::ADMIN,
        long,
        visible_alias = "metrics-port",
        env = "PD_EPP_ADMIN_PORT",
        value_name = "PORT"
    )]
    pub admin_port: Option<u16>,
    /// The older variable of --admin-port, read when neither the flag nor PD_EPP_ADMIN_PORT
    /// is set.
    #[arg(long = "legacy-metrics-port", env = "PD_EPP_METRICS_PORT", hide = true)]
    pub legacy_metrics_port: Option<u16>,
    /// Address of the --admin-port listener (default: --host).
    #[arg(help_heading = headings::ADMIN, long, env = "PD_EPP_ADMIN_HOST")]
    pub admin_host: Option<String>,
    /// Serve TLS with this certificate chain (PEM) on both listeners (gRPC and the admin's),
    /// re-read when the file changes: Envoy's cluster of the picker then needs an
    /// `UpstreamTlsContext`. Needs --tls-key.
    #[arg(help_heading = headings::LISTEN, long, env = "PD_EPP_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(help_heading = headings::LISTEN, long, env = "PD_EPP_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The engines, how they are found, checked and chosen. Without `--prefill` the engines
    /// (`--decode`) serve whole requests, one picked for each.
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// The port Envoy sends a decode's requests to, on the decode's host, when it is not the
    /// engine's own: the sidecar's (pd-proxy `--sidecar`) in each decode pod.
    #[arg(help_heading = headings::BACKENDS, long, env = "PD_EPP_DESTINATION_PORT")]
    pub destination_port: Option<u16>,
    /// Where Envoy sends one decode's requests: `ENGINE_URL=HOST:PORT` (its sidecar), for
    /// decodes whose sidecars do not share one port. Repeatable; wins over
    /// --destination-port.
    #[arg(help_heading = headings::BACKENDS, long = "destination", env = "PD_EPP_DESTINATIONS", value_delimiter = ',', value_parser = parse_destination)]
    pub destinations: Vec<(String, String)>,
    /// Key an operator must send as `Authorization: Bearer <key>` to drain an engine
    /// (`POST /admin/drain` on the metrics port); without it that route is off.
    #[arg(help_heading = headings::ADMIN, long, env = "PD_EPP_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Key requests must present as `Authorization: Bearer <key>` (the tenant `default`'s,
    /// beside --api-keys-file's); others are answered 401.
    #[arg(help_heading = headings::ADMIN, long, env = "PD_EPP_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Tenants, their API keys and their limits, as pd-proxy's --api-keys-file (TOML, or JSON
    /// for a `.json` name); re-read when it changes.
    #[arg(help_heading = headings::ADMIN, long, env = "PD_EPP_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// The largest request body buffered to place it, in bytes (413 above it).
    #[arg(help_heading = headings::LIMITS, long, env = "PD_EPP_MAX_BODY_BYTES", default_value_t = 32 << 20, value_parser = clap::value_parser!(usize))]
    pub max_body_bytes: usize,
    /// Log format.
    #[arg(help_heading = headings::OBSERVABILITY, long, env = "PD_EPP_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Seconds between the first SIGTERM/SIGINT and the end of accepting: readiness fails
    /// meanwhile (so the gateway stops sending), streams are served as usual.
    #[arg(help_heading = headings::LIMITS, long, env = "PD_EPP_SHUTDOWN_DELAY", default_value = "0", value_parser = parse_seconds_or_zero)]
    pub shutdown_delay: Duration,
}

/// Everything pd-epp needs, validated.
#[derive(Debug, Clone)]
pub struct Config {
    /// The fleet and the placement.
    pub router: RouterConfig,
    /// Host to listen on.
    pub host: String,
    /// Port of the gRPC services (0 picks a free one).
    pub port: u16,
    /// Host of the operator's HTTP listener.
    pub admin_host: String,
    /// Port of the operator's HTTP listener (0 picks a free one).
    pub admin_port: u16,
    /// TLS on both listeners, when set.
    pub tls: Option<TlsFiles>,
    /// The key requests must present, if any.
    pub api_key: Option<String>,
    /// The tenants' keys and limits, if any.
    pub api_keys_file: Option<PathBuf>,
    /// The largest request body buffered.
    pub max_body_bytes: usize,
    /// Where Envoy sends each decode's requests.
    pub destinations: Destinations,
    /// The key of the admin route, if it is on.
    pub admin_key: Option<String>,
}

/// Where Envoy sends a decode's requests: the engine's own address, unless a sidecar stands in
/// front of it.
#[derive(Debug, Clone, Default)]
pub struct Destinations {
    /// Every decode's sidecar port, on the decode's host.
    pub port: Option<u16>,
    /// One decode's (by its URL) destination, `host:port`.
    pub by_engine: HashMap<String, String>,
}

impl Destinations {
    /// The `host:port` Envoy routes `decode`'s requests to.
    pub fn of(&self, decode: &Backend) -> String {
        if let Some(address) = self.by_engine.get(decode.url()) {
            return address.clone();
        }
        let address = decode.address();
        match (self.port, address.rsplit_once(':')) {
            (Some(port), Some((host, _))) => format!("{host}:{port}"),
            _ => address.to_owned(),
        }
    }
}

/// `ENGINE_URL=HOST:PORT`.
fn parse_destination(text: &str) -> Result<(String, String), String> {
    let (engine, address) = text
        .rsplit_once('=')
        .ok_or_else(|| format!("{text:?}: expected ENGINE_URL=HOST:PORT"))?;
    let port = address
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse::<u16>().ok());
    if port.is_none() {
        return Err(format!("{address:?}: expected HOST:PORT"));
    }
    Ok((engine.trim_end_matches('/').to_owned(), address.to_owned()))
}

impl Config {
    /// A configuration with the binary's defaults for everything but the engines, listening on
    /// 127.0.0.1 with OS-chosen ports (for tests and benchmarks).
    pub fn new(router: RouterConfig) -> Self {
        Config {
            router,
            host: "127.0.0.1".to_owned(),
            port: 0,
            admin_host: "127.0.0.1".to_owned(),
            admin_port: 0,
            tls: None,
            api_key: None,
            api_keys_file: None,
            max_body_bytes: 32 << 20,
            destinations: Destinations::default(),
            admin_key: None,
        }
    }
}

impl Args {
    /// Parses a command line (with the flags of its `--config` file, the command line's
    /// winning).
    pub fn try_parse_args<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let command = || with_env_prefix(Args::command(), "PD_EPP_");
        parse_args(argv, command, |args: &mut Args| &mut args.fleet)
    }

    /// Parses the process's command line, exiting with clap's message on an error.
    pub fn parse_args() -> Self {
        Self::try_parse_args(std::env::args_os()).unwrap_or_else(|err| err.exit())
    }

    /// Validates the flags into a configuration. `prefill_env` is the value of [`PREFILL_ENV`],
    /// used only when no `--prefill` flag was given.
    pub fn into_config(self, prefill_env: Option<&str>) -> Result<Config, ConfigError> {
        Ok(Config {
            router: self.fleet.into_config(prefill_env, false)?,
            admin_host: self.admin_host.unwrap_or_else(|| self.host.clone()),
            host: self.host,
            port: self.port,
            admin_port: (self.admin_port)
                .or(self.legacy_metrics_port)
                .unwrap_or(DEFAULT_ADMIN_PORT),
            tls: (self.tls_cert.zip(self.tls_key)).map(|(cert, key)| TlsFiles {
                cert,
                key,
                client_ca: None,
            }),
            api_key: self.api_key.filter(|key| !key.is_empty()),
            api_keys_file: self.api_keys_file,
            max_body_bytes: self.max_body_bytes,
            destinations: Destinations {
                port: self.destination_port,
                by_engine: self.destinations.into_iter().collect(),
            },
            admin_key: self.admin_key.filter(|key| !key.is_empty()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shared_flags_read_pd_epp_variables() {
        let command = with_env_prefix(Args::command(), "PD_EPP_");
        let env = |long: &str| {
            let arg = command.get_arguments().find(|a| a.get_long() == Some(long));
            arg.and_then(|a| a.get_env())
                .map(|e| e.to_string_lossy().into_owned())
        };
        assert_eq!(env("decode").as_deref(), Some("PD_EPP_DECODE"));
        assert_eq!(env("policy").as_deref(), Some("PD_EPP_POLICY"));
        assert_eq!(env("port").as_deref(), Some("PD_EPP_PORT"));
    }

    #[test]
    fn engines_without_prefills_make_an_aggregated_fleet() {
        let args = Args::try_parse_args(["pd-epp", "--decode", "http://10.0.0.7:8000"]).unwrap();
        let config = args.into_config(None).unwrap();
        assert!(config.router.prefills.is_empty());
        assert_eq!(config.router.decodes, ["http://10.0.0.7:8000"]);
        let none = Args::try_parse_args(["pd-epp"]).unwrap().into_config(None);
        assert!(matches!(none, Err(ConfigError::NoDecode)));
    }

    #[test]
    fn every_flag_has_a_heading_and_so_a_section_of_the_config_file() {
        let unplaced = headings::without_section(&Args::command());
        assert!(unplaced.is_empty(), "{unplaced:?}");
    }

    #[test]
    fn the_older_name_of_the_admin_port_still_works_in_a_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("epp.toml");
        std::fs::write(&file, "[admin]\nmetrics-port = 9123\n").unwrap();
        let argv = [
            "pd-epp",
            "--decode",
            "http://d:1",
            "--config",
            file.to_str().unwrap(),
        ];
        let config = Args::try_parse_args(argv)
            .unwrap()
            .into_config(None)
            .unwrap();
        assert_eq!(config.admin_port, 9123);
        let plain = Args::try_parse_args(["pd-epp", "--decode", "http://d:1"]).unwrap();
        assert_eq!(
            plain.into_config(None).unwrap().admin_port,
            DEFAULT_ADMIN_PORT
        );
    }
}
