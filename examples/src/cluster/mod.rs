//! A whole P/D deployment on one machine, from the real binaries: one bootstrap server per
//! prefill engine (as on real rank-0 hosts), the prefill and decode engines (simulated:
//! `sim.rs`, one set per model with `models`; real vLLM: `real.rs`), and the proxy in front of
//! them all, finding them by URL or, with `dns`, through DNS (`dns.rs`). Used by the
//! `pd-cluster` launcher and by the end-to-end tests.

mod bootstraps;
pub mod demo;
pub mod dns;
pub mod gateway;
mod proxy;
mod real;
mod sim;
mod tls;

use std::path::PathBuf;

pub use gateway::{Gateway, GatewaySpec};
use proxy::{start_proxy, Found};
use std::time::Duration;
pub use tls::ClusterTls;

use futures_util::future::join_all;
use pd_transfer::Transport;

use crate::process::{ensure_free, Ports};
pub use crate::process::{free_port, spawn, spawn_with_env, wait_for, Process};
use crate::sim::Dialect;
use crate::vllm::{Connector, VllmEngines};

/// Why the cluster could not start.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A binary is missing from the binary folder.
    #[error("{path} not found: build the workspace binaries first (cargo build --release --bins)")]
    MissingBinary {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// A process could not be started.
    #[error("cannot start {name}: {source}")]
    Spawn {
        /// Which process.
        name: String,
        /// What failed.
        source: std::io::Error,
    },
    /// A process did not become ready in time.
    #[error(
        "{name} was not ready at {url} within {timeout:?} (log: {log}); its last lines:\n{tail}"
    )]
    NotReady {
        /// Which process.
        name: String,
        /// The URL polled.
        url: String,
        /// How long it was given.
        timeout: Duration,
        /// Its log file.
        log: String,
        /// The end of its log.
        tail: String,
    },
    /// A process exited during start-up.
    #[error("{name} exited during start-up with {status} (log: {log}); its last lines:\n{tail}")]
    Exited {
        /// Which process.
        name: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// Its log file.
        log: String,
        /// The end of its log.
        tail: String,
    },
    /// A preparation step (the vLLM environment, the tiny model) failed.
    #[error("{step} failed: {reason}")]
    Prepare {
        /// Which step.
        step: String,
        /// What it said.
        reason: String,
    },
    /// The spec asks for something the engines cannot do.
    #[error("{0}")]
    Unsupported(&'static str),
    /// A port the cluster needs is taken.
    #[error("port {port} on 127.0.0.1 is already in use: stop what holds it, or choose another with {flag}")]
    PortBusy {
        /// The port.
        port: u16,
        /// The flag that chooses it.
        flag: &'static str,
    },
    /// The run folder could not be prepared.
    #[error("cannot prepare {path}: {source}")]
    RunDir {
        /// The folder.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
}

/// The script a `python_registrar` runs beside each prefill engine (in this repository).
pub const REGISTER_ENGINE_SCRIPT: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/python/register_engine.py");

/// One prefill engine's parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillShape {
    /// Data-parallel size.
    pub dp: u32,
    /// Tensor-parallel size.
    pub tp: u32,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// The folder holding `bootstrap-server`, `sim-engine` and `pd-proxy`.
    pub bin_dir: PathBuf,
    /// Where logs and databases go.
    pub run_dir: PathBuf,
    /// The prefill engines.
    pub prefills: Vec<PrefillShape>,
    /// How many decode engines.
    pub decodes: usize,
    /// The proxy's port (0: any free port).
    pub proxy_port: u16,
    /// The other processes take consecutive ports from this one (none: free ephemeral ports).
    pub base_port: Option<u16>,
    /// sim-engine's prefill time per prompt token, in µs.
    pub prefill_us_per_token: u64,
    /// sim-engine's decode time per token, in ms.
    pub decode_ms_per_token: u64,
    /// Extra flags for the proxy.
    pub proxy_args: Vec<String>,
    /// Environment variables for the proxy (e.g. `OTEL_EXPORTER_OTLP_ENDPOINT`).
    pub proxy_env: Vec<(String, String)>,
    /// Extra flags for every sim-engine (prefills and decodes).
    pub engine_args: Vec<String>,
    /// More arguments of each decode, by index (decode `i` gets `decode_args[i]`, if any):
    /// e.g. a fault injected into one.
    pub decode_args: Vec<Vec<String>>,
    /// The KV transport of the prefill engines.
    pub transfer: Transport,
    /// The prefill engines register under leases of this many seconds (none: until
    /// deregistered). vLLM only: SGLang's wire has no leases.
    pub lease_ttl: Option<u32>,
    /// Whose engines the sims play (and the proxy's mode): vLLM's or SGLang's.
    pub dialect: Dialect,
    /// The Python interpreter (with the pd_bootstrap package installed) that registers the
    /// prefill workers through the binding, running `examples/python/register_engine.py` beside
    /// each prefill, instead of the engines themselves (none: the engines do). vLLM only.
    pub python_registrar: Option<PathBuf>,
    /// Real vLLM engines in place of the simulated ones (none: sim-engine). `prefills` must
    /// then be engines of dp=1,tp=1; `dialect` stays vLLM.
    pub vllm: Option<VllmEngines>,
    /// The sims publish their KV cache events as vLLM does (`--kv-events-config`, with a replay
    /// socket) and the proxies follow them (`--kv-events`).
    pub kv_events: bool,
    /// How many proxies, each in front of every engine (replicas of one front door).
    pub proxies: usize,
    /// How many models the simulated engines serve (1 unless asked). With more, each model
    /// has engines of its own, `prefills` and `decodes` over again, serving
    /// [`model_name`]`(k, models)`; in vLLM's dialect model 0's load [`LORA_ADAPTERS`] at start
    /// and may load more at run time. Real vLLM engines serve one model.
    pub models: usize,
    /// The proxies find the engines through DNS (`dns://` names served by a dnsmasq the
    /// cluster starts: [`dns`]), as on Kubernetes, instead of by their URLs. Simulated engines
    /// only.
    pub dns: bool,
    /// The prefills serve both roles (vLLM's `kv_both`): started as such and given to the
    /// proxy with `--dual`, which splits them between prefill and decode duty; the decodes, if
    /// any, stay decode-only. vLLM's wire (simulated, or real with the Mooncake connector),
    /// found by URL.
    pub dual: bool,
    /// Behind a gateway ([`gateway`]): Envoy as the front door with pd-epp as its endpoint
    /// picker and a pd-proxy sidecar beside each decode, in place of the proxy (none: pd-proxy).
    pub gateway: Option<GatewaySpec>,
    /// Every listener speaks HTTPS, every call presents a client certificate ([`ClusterTls`]);
    /// none: plain HTTP. Not with `dns` or `gateway`.
    pub tls: Option<ClusterTls>,
}

/// The LoRA adapters model 0's engines load at start when a cluster serves several models
/// (`--lora-modules`, `name=path`); they run with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`, so
/// `POST /v1/load_lora_adapter` loads more.
pub const LORA_ADAPTERS: [(&str, &str); 2] =
    [("sim-lora-a", "/adapters/a"), ("sim-lora-b", "/adapters/b")];

/// The name model `k` of `models` is served as: sim-engine's default, `sim-model`, when the
/// cluster serves one, else `sim-model-<k>`.
pub fn model_name(k: usize, models: usize) -> String {
    match models {
        0 | 1 => crate::sim::config::SIM_MODEL.to_owned(),
        _ => format!("{}-{k}", crate::sim::config::SIM_MODEL),
    }
}

/// One model a cluster serves, and the engines serving it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedModel {
    /// The model's name (requests' `model`).
    pub name: String,
    /// The LoRA adapters its engines loaded at start (also requests' `model`).
    pub adapters: Vec<String>,
    /// Its prefill engines' URLs.
    pub prefills: Vec<String>,
    /// Its decode engines' URLs.
    pub decodes: Vec<String>,
}

impl ClusterSpec {
    /// The demo deployment: prefills with dp=2,tp=2 and dp=1,tp=2, two decodes.
    pub fn demo(bin_dir: PathBuf, run_dir: PathBuf) -> Self {
        ClusterSpec {
            bin_dir,
            run_dir,
            prefills: vec![PrefillShape { dp: 2, tp: 2 }, PrefillShape { dp: 1, tp: 2 }],
            decodes: 2,
            proxy_port: 0,
            base_port: None,
            prefill_us_per_token: 500,
            decode_ms_per_token: 10,
            proxy_args: Vec::new(),
            proxy_env: Vec::new(),
            engine_args: Vec::new(),
            decode_args: Vec::new(),
            transfer: Transport::Tcp,
            lease_ttl: Some(10),
            dialect: Dialect::Vllm,
            python_registrar: None,
            vllm: None,
            kv_events: true,
            proxies: 1,
            models: 1,
            dns: false,
            dual: false,
            gateway: None,
            tls: None,
        }
    }

    /// The base URL of one of the cluster's servers on `port`: HTTPS with `tls`.
    pub(crate) fn url(&self, port: u16) -> String {
        match &self.tls {
            Some(_) => ClusterTls::url(port),
            None => format!("http://127.0.0.1:{port}"),
        }
    }

    /// What callers of its servers trust and present.
    pub(crate) fn caller_tls(&self) -> worker_client::ClientTls {
        (self.tls.as_ref()).map_or_else(Default::default, ClusterTls::caller)
    }

    /// The shape of every prefill engine, model after model (`prefills` once per model).
    pub(crate) fn prefill_engines(&self) -> impl Iterator<Item = PrefillShape> + '_ {
        (0..self.models.max(1)).flat_map(|_| self.prefills.iter().copied())
    }
}

/// A running cluster. Dropping it kills every process; [`Cluster::shutdown`] stops them
/// gracefully.
pub struct Cluster {
    /// The bootstrap servers, one per prefill engine.
    pub bootstraps: Vec<Process>,
    /// The prefill engines.
    pub prefills: Vec<Process>,
    /// The Python processes registering the prefills' workers (with `python_registrar`).
    pub registrars: Vec<Process>,
    /// The decode engines.
    pub decodes: Vec<Process>,
    /// The front door: the proxy, or Envoy with `spec.gateway`.
    pub proxy: Process,
    /// pd-epp and the sidecars, with `spec.gateway`.
    pub gateway: Option<Gateway>,
    /// The other proxies (`spec.proxies` beyond the first), each in front of every engine.
    pub replicas: Vec<Process>,
    /// The models served, each with its engines.
    models: Vec<ServedModel>,
    /// The DNS server naming the engines (`spec.dns`): its records can be changed.
    pub dns: Option<crate::dnsmasq::Dnsmasq>,
}

impl Cluster {
    /// Starts everything on 127.0.0.1 and waits until the proxy is ready to serve: the
    /// bootstrap servers, then the engines (simulated, or real vLLM with `spec.vllm`) until
    /// their workers are registered, then the proxy.
    pub async fn start(spec: &ClusterSpec) -> Result<Cluster, ClusterError> {
        if spec.vllm.is_some() && spec.models > 1 {
            return Err(ClusterError::Unsupported(
                "real vLLM engines serve one model here: several models need the simulated engines",
            ));
        }
        if spec.tls.is_some() && spec.dns {
            return Err(ClusterError::Unsupported(
                "TLS is made for clusters whose proxy finds the engines by URL",
            ));
        }
        if spec.tls.is_some() && spec.python_registrar.is_some() {
            return Err(ClusterError::Unsupported(
                "with TLS the engines register themselves, not through Python registrars",
            ));
        }
        let mooncake = (spec.vllm.as_ref()).is_none_or(|v| v.connector == Connector::Mooncake);
        if spec.dual && (spec.dns || spec.dialect != Dialect::Vllm || !mooncake) {
            return Err(ClusterError::Unsupported(
                "engines of both roles play vLLM with the Mooncake connector, found by URL",
            ));
        }
        if spec.vllm.is_some() && spec.dns {
            return Err(ClusterError::Unsupported(
                "the engines are found through DNS with the simulated engines only",
            ));
        }
        std::fs::create_dir_all(&spec.run_dir).map_err(|source| ClusterError::RunDir {
            path: spec.run_dir.clone(),
            source,
        })?;
        let bootstrap_bin = binary(spec, "bootstrap-server")?;
        let proxy_bin = binary(spec, "pd-proxy")?;
        // Every port is checked before anything starts, so a busy one fails at once.
        if spec.proxy_port != 0 {
            ensure_free(spec.proxy_port, "--port")?;
        }
        let mut ports = Ports {
            next: spec.base_port,
        };
        let mut bootstraps = bootstraps::start(spec, &bootstrap_bin, &mut ports).await?;
        let engines = match &spec.vllm {
            None => sim::start(spec, &mut ports, &mut bootstraps).await?,
            Some(vllm) => real::start(spec, vllm, &mut ports, &mut bootstraps).await?,
        };
        let dns = match spec.dns {
            true => Some(dns::start(&spec.run_dir, &engines, &bootstraps, false).await?),
            false => None,
        };
        if let Some(gateway) = &spec.gateway {
            if spec.dns {
                return Err(ClusterError::Unsupported(
                    "behind a gateway the engines are found by their URLs, not through DNS",
                ));
            }
            let found = Found::Urls(&engines, &bootstraps);
            let started = gateway::start(spec, gateway, &mut ports, found, &engines.decodes);
            let (envoy, parts) = started.await?;
            return Ok(Cluster {
                bootstraps,
                prefills: engines.prefills,
                registrars: engines.registrars,
                decodes: engines.decodes,
                proxy: envoy,
                gateway: Some(parts),
                replicas: Vec::new(),
                models: engines.models,
                dns,
            });
        }
        let mut proxies = Vec::new();
        for i in 0..spec.proxies.max(1) {
            let name = match i {
                0 => "proxy".to_owned(),
                i => format!("proxy-{i}"),
            };
            let found = match &dns {
                Some(dns) => Found::Dns(dns),
                None => Found::Urls(&engines, &bootstraps),
            };
            let started = start_proxy(spec, &proxy_bin, &mut ports, found, &name);
            proxies.push(started.await?);
        }
        let proxy = proxies.remove(0);
        Ok(Cluster {
            bootstraps,
            prefills: engines.prefills,
            registrars: engines.registrars,
            decodes: engines.decodes,
            proxy,
            gateway: None,
            replicas: proxies,
            models: engines.models,
            dns,
        })
    }

    /// The models served, in order, each with its adapters and the URLs of its engines.
    pub fn models(&self) -> &[ServedModel] {
        &self.models
    }

    /// Every process, front doors first (the order to stop them in).
    pub fn processes(&mut self) -> impl Iterator<Item = &mut Process> {
        let gateway = self
            .gateway
            .iter_mut()
            .flat_map(|g| std::iter::once(&mut g.epp).chain(g.sidecars.iter_mut()));
        std::iter::once(&mut self.proxy)
            .chain(gateway)
            .chain(self.replicas.iter_mut())
            .chain(self.decodes.iter_mut())
            .chain(self.registrars.iter_mut())
            .chain(self.prefills.iter_mut())
            .chain(self.bootstraps.iter_mut())
    }

    /// Stops every process gracefully, in order: the proxy, the decodes, the registrars and
    /// then the prefills (whose lease revocations still reach a running bootstrap server), then
    /// the bootstrap servers; each group at once, each process with SIGTERM and SIGKILL after
    /// its grace (a second; ten for a vLLM engine).
    pub async fn shutdown(mut self) {
        let grace = self.proxy.stop_grace;
        self.proxy.stop(grace).await;
        if let Some(gateway) = &mut self.gateway {
            gateway.epp.stop(grace).await;
            join_all(gateway.sidecars.iter_mut().map(|p| p.stop(grace))).await;
        }
        let groups = [
            &mut self.replicas,
            &mut self.decodes,
            &mut self.registrars,
            &mut self.prefills,
            &mut self.bootstraps,
        ];
        for group in groups {
            join_all(group.iter_mut().map(|process| {
                let grace = process.stop_grace;
                process.stop(grace)
            }))
            .await;
        }
    }
}

/// The engines a cluster started, and the processes registering them.
pub(crate) struct Engines {
    pub(crate) prefills: Vec<Process>,
    pub(crate) registrars: Vec<Process>,
    pub(crate) decodes: Vec<Process>,
    pub(crate) models: Vec<ServedModel>,
}

/// How long a Rust process of the cluster may take to answer.
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The text of a flag's value.
pub(crate) fn s(value: &dyn ToString) -> String {
    value.to_string()
}

/// The binary `name` of the binary folder.
pub(crate) fn binary(spec: &ClusterSpec, name: &str) -> Result<PathBuf, ClusterError> {
    let path = spec.bin_dir.join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(ClusterError::MissingBinary { path })
    }
}
