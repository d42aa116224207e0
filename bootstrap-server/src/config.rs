//! Command-line flags of the `bootstrap-server` binary (each with an environment fallback).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};
use ipnet::IpNet;
use pd_protocol::{Rank, MAX_RANK};
use pd_service::{parse_seconds, parse_seconds_or_zero, LogFormat, TlsFiles};

use crate::instances::{self, InstanceConfig};
use crate::registry::{EngineConflictPolicy, ExpectedTopology, RegistryConfig};
use crate::server::ServerConfig;
use crate::store::EtcdConfig;

/// `--help`'s headings.
const LISTEN: &str = "Listen and TLS";
const STORE: &str = "Store";
const REGISTRY: &str = "Registry";
const LIMITS: &str = "Timeouts and limits";
const OBSERVABILITY: &str = "Observability";
const ADMIN: &str = "Writers, admin and keys";

/// The pd-bootstrap registry: run it once per prefill deployment, on rank 0.
#[derive(Debug, Parser)]
#[command(name = "bootstrap-server", version, about)]
pub struct Args {
    /// Address to listen on.
    #[arg(help_heading = LISTEN, long, env = "PD_BOOTSTRAP_HOST", default_value = "0.0.0.0")]
    pub host: IpAddr,
    /// Port to listen on. vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT (the variable its Mooncake
    /// connector reads) is read too when neither the flag nor PD_BOOTSTRAP_PORT is set.
    #[arg(help_heading = LISTEN, long, env = "PD_BOOTSTRAP_PORT", default_value_t = 8998)]
    pub port: u16,
    /// Serve HTTPS with this certificate chain (PEM), re-read when the file changes. Needs
    /// --tls-key.
    #[arg(help_heading = LISTEN, long, env = "PD_BOOTSTRAP_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(help_heading = LISTEN, long, env = "PD_BOOTSTRAP_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// CA certificates (PEM) that client certificates are verified against: a write whose
    /// connection presented one that verified is let through (reads stay open). Needs
    /// --tls-cert.
    #[arg(help_heading = ADMIN, long, env = "PD_BOOTSTRAP_TLS_CLIENT_CA", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
    /// Serve the operator's routes (`/metrics`, `/ui`, and the probes) on a listener of their
    /// own, on this port (0: any free one): the workers' port then answers them with 404.
    #[arg(help_heading = ADMIN, long, env = "PD_BOOTSTRAP_ADMIN_PORT")]
    pub admin_port: Option<u16>,
    /// Address of the --admin-port listener.
    #[arg(help_heading = ADMIN, long, env = "PD_BOOTSTRAP_ADMIN_HOST", default_value = "127.0.0.1")]
    pub admin_host: IpAddr,
    /// Leave `GET /metrics` on the workers' port open to scrapers while writes are protected
    /// (the live page then still needs what writes need).
    #[arg(help_heading = ADMIN, long, env = "PD_BOOTSTRAP_METRICS_OPEN")]
    pub metrics_open: bool,
    /// Folder of the embedded sled database (created if absent; unused with `--store etcd://`).
    #[arg(help_heading = STORE, long, env = "PD_BOOTSTRAP_DATA_DIR", default_value = "bootstrap-data")]
    pub data_dir: PathBuf,
    /// Keep the registry in etcd, shared by every bootstrap replica pointed at it:
    /// `etcd://HOST:PORT[,HOST:PORT...]`. Without it the embedded sled database is used.
    #[arg(help_heading = STORE, long, env = "PD_BOOTSTRAP_STORE", value_parser = parse_store)]
    pub store: Option<EtcdEndpoints>,
    /// With `--store etcd://`: the cluster name, the key prefix that keeps deployments sharing
    /// one etcd apart. Replicas of one deployment use the same name.
    #[arg(help_heading = STORE, long, env = "PD_BOOTSTRAP_CLUSTER", default_value = "default", value_parser = parse_cluster)]
    pub cluster: String,
    /// With `--store etcd://`: seconds one etcd call may take before the HTTP call answers 503.
    #[arg(help_heading = STORE, long, env = "PD_BOOTSTRAP_STORE_TIMEOUT", default_value = "3", value_parser = parse_seconds)]
    pub store_timeout: Duration,
    /// Seconds a request id lives after registration (fractions allowed).
    #[arg(help_heading = REGISTRY, long, env = "PD_BOOTSTRAP_REQUEST_TTL", default_value = "960", value_parser = parse_seconds)]
    pub request_ttl: Duration,
    /// Seconds a bootstrap room (SGLang's `POST /register_dp_rank`) lives after registration
    /// (SGLang's own server keeps one 120 to 240 s).
    #[arg(help_heading = REGISTRY, long, env = "PD_BOOTSTRAP_ROOM_TTL", default_value = "120", value_parser = parse_seconds)]
    pub room_ttl: Duration,
    /// The most live request ids held at once; registering more answers 503.
    #[arg(help_heading = REGISTRY, long, env = "PD_BOOTSTRAP_MAX_REQUESTS", default_value_t = 2_000_000)]
    pub max_requests: usize,
    /// Expected number of dp ranks; with any of the three sizes, `/query` answers 503 until the
    /// topology is complete (unset sizes count as 1) and larger ranks are refused.
    #[arg(help_heading = REGISTRY, long, env = "PD_BOOTSTRAP_DP_SIZE", value_parser = size_parser())]
    pub dp_size: Option<Rank>,
    /// Expected number of tp ranks per dp rank.
    #[arg(help_heading = REGISTRY, long, env = "PD_BOOTSTRAP_TP_SIZE", value_parser = size_parser())]
    pub tp_size: Option<Rank>,
    /// Expected number of pp ranks.
    #[arg(help_heading = REGISTRY, long, env = "PD_BOOTSTRAP_PP_SIZE", value_parser = size_parser())]
    pub pp_size: Option<Rank>,
    /// What a registration for a slot held by another engine (or by the same engine id at
    /// another address: a restart) does: `replace` (takeover; the old engine leaves whole) or
    /// `reject` (vLLM's 400, unless the request says `"replace": true`).
    #[arg(help_heading = REGISTRY, long, env = "PD_BOOTSTRAP_ENGINE_CONFLICT", value_enum, default_value_t = EngineConflictPolicy::Replace)]
    pub engine_conflict: EngineConflictPolicy,
    /// Without --tp-size: seconds a dp group's ranks must form a whole grid (tp ranks 0..N-1,
    /// each with pp ranks 0..M-1) with none joining or leaving before `GET /query` shows it; a
    /// stock vLLM decode keeps the first answer it gets for its life and takes P's tp size from
    /// it, so a half-registered P would stay half for it. Until then `/query` answers 503 for it.
    #[arg(help_heading = REGISTRY, long, env = "PD_BOOTSTRAP_SETTLE", default_value = "2", value_parser = parse_seconds_or_zero)]
    pub settle: Duration,
    /// A further registry in this process, `NAME=PORT` (repeatable; 0: any free port), with its
    /// own store: for vLLM instances that all register as dp_rank 0 (external or hybrid DP load
    /// balancing). Its prefills register at PORT; it is also served under `/instances/NAME`
    /// on --port. Several in the variable: comma separated.
    #[arg(help_heading = REGISTRY, long = "instance", env = "PD_BOOTSTRAP_INSTANCES", value_delimiter = ',', value_parser = InstanceConfig::parse)]
    pub instances: Vec<InstanceConfig>,
    /// Bearer token required on every write route (reads stay open), except from peers inside
    /// --allow-writes-from.
    #[arg(help_heading = ADMIN, long, env = "PD_BOOTSTRAP_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<String>,
    /// Networks (CIDR, or single addresses) whose peers may write without a token, comma
    /// separated: e.g. the prefill nodes' subnet, for stock vLLM/SGLang workers that cannot send
    /// one. Peers outside get 403 (or need --auth-token, when set). Reads stay open.
    #[arg(help_heading = ADMIN, long, env = "PD_BOOTSTRAP_ALLOW_WRITES_FROM", value_delimiter = ',', value_parser = parse_net)]
    pub allow_writes_from: Vec<IpNet>,
    /// Seconds a client has to send a request's headers (also on an idle keep-alive
    /// connection, which is then closed), and then again for its body and the answer, or it
    /// gets a 408: what a slow or stuck client can hold a connection for.
    #[arg(help_heading = LIMITS, long, env = "PD_BOOTSTRAP_REQUEST_TIMEOUT", default_value = "30", value_parser = parse_seconds)]
    pub request_timeout: Duration,
    /// Log format.
    #[arg(help_heading = OBSERVABILITY, long, env = "PD_BOOTSTRAP_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Seconds between the first SIGTERM/SIGINT and the end of accepting: `/readyz` and
    /// `/ready` answer 503 meanwhile, everything else is served as usual (so that Kubernetes
    /// takes the pod out of its endpoints first). A second signal ends it early.
    #[arg(help_heading = LIMITS, long, env = "PD_BOOTSTRAP_SHUTDOWN_DELAY", default_value = "0", value_parser = parse_seconds_or_zero)]
    pub shutdown_delay: Duration,
    /// Seconds the requests in flight when the server stops accepting may run on before their
    /// connections are closed (long polls answer at once).
    #[arg(help_heading = LIMITS, long, env = "PD_BOOTSTRAP_SHUTDOWN_GRACE", default_value = "30", value_parser = parse_seconds_or_zero)]
    pub shutdown_grace: Duration,
}

/// The etcd members named by `--store`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdEndpoints(pub Vec<String>);

fn parse_store(url: &str) -> Result<EtcdEndpoints, String> {
    EtcdConfig::parse_url(url).map(EtcdEndpoints)
}

/// A cluster name: 1 to 64 letters, digits, `.`, `_` or `-`.
fn parse_cluster(name: &str) -> Result<String, String> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if valid {
        Ok(name.to_owned())
    } else {
        Err(format!(
            "{name:?} must be 1 to 64 letters, digits, '.', '_' or '-'"
        ))
    }
}

/// A network in CIDR notation, or one address (a /32 or /128).
fn parse_net(text: &str) -> Result<IpNet, String> {
    let text = text.trim();
    text.parse::<IpNet>()
        .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
        .map_err(|_| format!("{text:?} is not a network (CIDR such as 10.0.0.0/16) or an address"))
}

fn size_parser() -> clap::builder::RangedI64ValueParser<Rank> {
    clap::value_parser!(u32).range(1..=i64::from(MAX_RANK) + 1)
}

impl Args {
    /// The server settings these flags describe.
    pub fn server_config(&self) -> ServerConfig {
        let expected = (self.dp_size.is_some() || self.tp_size.is_some() || self.pp_size.is_some())
            .then(|| ExpectedTopology {
                dp_size: self.dp_size.unwrap_or(1),
                tp_size: self.tp_size.unwrap_or(1),
                pp_size: self.pp_size.unwrap_or(1),
            });
        ServerConfig {
            addr: (self.host, self.port).into(),
            data_dir: self.data_dir.clone(),
            etcd: self
                .store
                .clone()
                .map(|EtcdEndpoints(endpoints)| EtcdConfig {
                    endpoints,
                    cluster: self.cluster.clone(),
                    op_timeout: self.store_timeout,
                }),
            auth_token: self.auth_token.clone().filter(|t| !t.is_empty()),
            allow_writes_from: self.allow_writes_from.clone(),
            registry: RegistryConfig {
                expected,
                request_ttl: self.request_ttl,
                room_ttl: self.room_ttl,
                max_requests: self.max_requests,
                engine_conflict: self.engine_conflict,
                settle: self.settle,
            },
            request_timeout: self.request_timeout,
            shutdown_grace: self.shutdown_grace,
            tls: (self.tls_cert.clone().zip(self.tls_key.clone())).map(|(cert, key)| TlsFiles {
                cert,
                key,
                client_ca: self.tls_client_ca.clone(),
            }),
            admin_addr: self.admin_port.map(|port| (self.admin_host, port).into()),
            metrics_open: self.metrics_open,
            instances: self.instances.clone(),
        }
    }

    /// Parses the process's command line and environment, exiting with clap's message on an
    /// error.
    pub fn parse_args() -> Self {
        Self::try_parse_with_env(std::env::args_os(), |name| std::env::var(name).ok())
            .unwrap_or_else(|err| err.exit())
    }

    /// Parses `argv`, reading the compatible environment names ([`PORT_ALIAS`]) through `env`
    /// (clap reads the flags' own variables).
    pub fn try_parse_with_env<I, T>(
        argv: I,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = Args::command().try_get_matches_from(argv)?;
        let mut args = Args::from_arg_matches(&matches)?;
        if matches.value_source("port") == Some(ValueSource::DefaultValue) {
            if let Some(text) = env(PORT_ALIAS) {
                args.port = text.trim().parse().map_err(|_| {
                    Args::command().error(
                        ErrorKind::InvalidValue,
                        format!("{PORT_ALIAS}={text:?} is not a port number"),
                    )
                })?;
            }
        }
        if let Err(err) = instances::check_all(&args.instances, args.port) {
            return Err(Args::command().error(ErrorKind::ArgumentConflict, err));
        }
        Ok(args)
    }
}

/// vLLM's name of the bootstrap port, read when neither `--port` nor PD_BOOTSTRAP_PORT is set.
pub const PORT_ALIAS: &str = "VLLM_MOONCAKE_BOOTSTRAP_PORT";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_timeout_defaults_to_the_servers() {
        let args = Args::try_parse_from(["bootstrap-server"]).unwrap();
        assert_eq!(
            args.server_config().request_timeout,
            crate::server::DEFAULT_REQUEST_TIMEOUT
        );
        assert_eq!(args.shutdown_delay, Duration::ZERO);
        assert_eq!(args.server_config().shutdown_grace, Duration::from_secs(30));
    }

    #[test]
    fn flags_map_to_config() {
        let args = Args::try_parse_from([
            "bootstrap-server",
            "--port",
            "0",
            "--tp-size",
            "2",
            "--request-ttl",
            "1.5",
            "--request-timeout",
            "2.5",
            "--store",
            "etcd://127.0.0.1:2379,10.0.0.2:2379",
            "--cluster",
            "prod-a",
            "--allow-writes-from",
            "10.0.0.0/16, 192.168.1.7",
            "--shutdown-delay",
            "5",
            "--shutdown-grace",
            "0",
        ])
        .unwrap();
        let config = args.server_config();
        assert_eq!(
            config.etcd,
            Some(EtcdConfig {
                endpoints: vec!["127.0.0.1:2379".into(), "10.0.0.2:2379".into()],
                cluster: "prod-a".into(),
                op_timeout: Duration::from_secs(3),
            })
        );
        assert_eq!(
            config.registry.expected,
            Some(ExpectedTopology {
                dp_size: 1,
                tp_size: 2,
                pp_size: 1
            })
        );
        assert_eq!(config.registry.request_ttl, Duration::from_millis(1500));
        assert_eq!(config.request_timeout, Duration::from_millis(2500));
        assert_eq!(args.shutdown_delay, Duration::from_secs(5));
        assert_eq!(config.shutdown_grace, Duration::ZERO);
        assert_eq!(
            config.allow_writes_from,
            vec![
                "10.0.0.0/16".parse::<IpNet>().unwrap(),
                "192.168.1.7/32".parse().unwrap()
            ]
        );
        assert_eq!(
            config.registry.engine_conflict,
            EngineConflictPolicy::Replace,
            "takeover is the default"
        );
    }

    #[test]
    fn bad_flags_are_refused() {
        for bad in [
            &["--request-ttl", "-1"][..],
            &["--request-ttl", "soon"],
            &["--dp-size", "0"],
            &["--port", "70000"],
            &["--engine-conflict", "maybe"],
            &["--allow-writes-from", "10.0.0.0/33"],
            &["--allow-writes-from", "nonsense"],
            &["--store", "sled://here"],
            &["--store", "etcd://"],
            &["--cluster", "a/b"],
            &["--cluster", ""],
            &["--shutdown-delay", "-1"],
            &["--shutdown-grace", "soon"],
        ] {
            let argv = std::iter::once("bootstrap-server").chain(bad.iter().copied());
            assert!(Args::try_parse_from(argv).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn vllms_port_variable_is_read_when_nothing_else_sets_the_port() {
        let env =
            |value: &'static str| move |name: &str| (name == PORT_ALIAS).then(|| value.to_owned());
        let parse =
            |argv: &[&str], value| Args::try_parse_with_env(argv.iter().copied(), env(value));
        assert_eq!(parse(&["bootstrap-server"], "9100").unwrap().port, 9100);
        assert_eq!(
            parse(&["bootstrap-server", "--port", "9200"], "9100")
                .unwrap()
                .port,
            9200
        );
        let err = parse(&["bootstrap-server"], "http")
            .unwrap_err()
            .to_string();
        assert!(err.contains(PORT_ALIAS), "{err}");
        let none = Args::try_parse_with_env(["bootstrap-server"], |_| None).unwrap();
        assert_eq!(none.port, 8998);
    }

    #[test]
    fn instances_are_read_from_flags_or_the_variable_and_checked_together() {
        let parse = |argv: &[&str]| Args::try_parse_with_env(argv.iter().copied(), |_| None);
        let args = parse(&[
            "bootstrap-server",
            "--instance",
            "b=8999",
            "--instance",
            "c=0",
        ]);
        let names: Vec<_> = (args.unwrap().server_config().instances.into_iter())
            .map(|i| (i.name, i.port))
            .collect();
        assert_eq!(names, [("b".to_owned(), 8999), ("c".to_owned(), 0)]);
        let err = parse(&["bootstrap-server", "--instance", "b=8998"]).unwrap_err();
        assert!(err.to_string().contains("port 8998"), "{err}");
        let err = parse(&["bootstrap-server", "--instance", "b=1", "--instance", "b=2"]);
        assert!(err.unwrap_err().to_string().contains("twice"));
        assert!(parse(&["bootstrap-server", "--instance", "B=1"]).is_err());
        let from_env = Args::command()
            .get_arguments()
            .find(|arg| arg.get_id() == "instances")
            .and_then(|arg| arg.get_env().map(|env| env.to_string_lossy().into_owned()));
        assert_eq!(from_env.as_deref(), Some("PD_BOOTSTRAP_INSTANCES"));
    }

    #[test]
    fn tls_and_admin_flags_map_to_config() {
        let args = Args::try_parse_from([
            "bootstrap-server",
            "--tls-cert",
            "c.pem",
            "--tls-key",
            "k.pem",
            "--tls-client-ca",
            "ca.pem",
            "--admin-port",
            "9099",
            "--metrics-open",
        ])
        .unwrap();
        let config = args.server_config();
        let tls = config.tls.unwrap();
        assert_eq!(
            tls.client_ca.as_deref(),
            Some(std::path::Path::new("ca.pem"))
        );
        assert_eq!(config.admin_addr, Some("127.0.0.1:9099".parse().unwrap()));
        assert!(config.metrics_open);
        for lone in [
            ["--tls-cert", "c.pem"],
            ["--tls-key", "k.pem"],
            ["--tls-client-ca", "ca.pem"],
        ] {
            let argv = std::iter::once("bootstrap-server").chain(lone);
            assert!(
                Args::try_parse_from(argv).is_err(),
                "{lone:?} alone was accepted"
            );
        }
    }

    #[test]
    fn every_flag_reads_a_pd_bootstrap_variable_and_has_a_heading() {
        let command = Args::command();
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            if ["help", "version"].contains(&id) {
                continue;
            }
            let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
            assert!(
                env.as_deref()
                    .is_some_and(|e| e.starts_with("PD_BOOTSTRAP_")),
                "--{id}: {env:?}"
            );
            assert!(arg.get_help_heading().is_some(), "--{id} has no heading");
        }
    }
}
