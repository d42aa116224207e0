//! The systems a timed replay compares, each in front of the same fleet: pd-proxy with each of
//! its policies on a fixed P:D split, pd-proxy moving engines of both roles between the duties
//! by its planner, pd-proxy whose planner's desired engines the bench actuates, and the peer
//! routers (vllm-router, smg) with their best P/D setup (cache-aware prefill, power-of-two
//! decode, round robin over a single decode), in front of every prefill and decode.

use std::path::Path;

use crate::bench::proxy::launch;
use crate::cluster::{free_port, Cluster, Process};
use crate::sim::Dialect;

/// A system under test.
#[derive(Debug, Clone, Copy)]
pub struct System {
    /// Its name in the report.
    pub name: &'static str,
    /// The engines' wire it needs.
    pub dialect: Dialect,
    /// Whether the engines publish KV events (pd-proxy's precise routing reads them).
    pub kv_events: bool,
    /// pd-proxy's flags, or the peer's program in the peers' virtualenv.
    pub front: Front,
    /// How the fleet's engines serve the roles.
    pub roles: Roles,
}

/// How a system's fleet serves the two roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Roles {
    /// Each engine a prefill or a decode for the whole run, on each split swept.
    Fixed,
    /// Every engine of both roles (vLLM's `kv_both`), pd-proxy splitting them between the
    /// duties by its planner's needs, on a fleet of each size swept.
    Moving,
    /// The best fixed split's engines, stopped and started by the bench as pd-proxy's planner
    /// desires ([`super::autoscale`]).
    Autoscaled,
}

/// What answers the clients.
#[derive(Debug, Clone, Copy)]
pub enum Front {
    /// The cluster's pd-proxy with these flags.
    PdProxy(&'static [&'static str]),
    /// vllm-router in vLLM Mooncake mode.
    VllmRouter,
    /// smg in its P/D mode (SGLang's wire).
    Smg,
}

/// Every system; the peers only with their virtualenv.
pub fn all(with_peers: bool) -> Vec<System> {
    let pd_proxy = |name, flags, kv_events| System {
        name,
        dialect: Dialect::Vllm,
        kv_events,
        front: Front::PdProxy(flags),
        roles: Roles::Fixed,
    };
    // The planner's systems route as precise_prefix does, so that only the roles differ.
    let precise = &[
        "--prefill-policy",
        "precise_prefix",
        "--decode-policy",
        "least_loaded",
    ][..];
    let mut systems = vec![
        pd_proxy(
            "pd-proxy round_robin",
            &["--policy", "round_robin"][..],
            false,
        ),
        pd_proxy(
            "pd-proxy least_loaded",
            &["--policy", "least_loaded"],
            false,
        ),
        pd_proxy(
            "pd-proxy cache_aware",
            &[
                "--prefill-policy",
                "cache_aware",
                "--decode-policy",
                "least_loaded",
            ],
            false,
        ),
        pd_proxy("pd-proxy precise_prefix", precise, true),
        System {
            roles: Roles::Moving,
            ..pd_proxy("pd-proxy moving roles", precise, true)
        },
        System {
            roles: Roles::Autoscaled,
            ..pd_proxy("pd-proxy autoscaled", precise, true)
        },
    ];
    if with_peers {
        systems.push(System {
            name: "vllm-router cache_aware",
            dialect: Dialect::Vllm,
            kv_events: false,
            front: Front::VllmRouter,
            roles: Roles::Fixed,
        });
        systems.push(System {
            name: "smg cache_aware",
            dialect: Dialect::Sglang,
            kv_events: false,
            front: Front::Smg,
            roles: Roles::Fixed,
        });
    }
    systems
}

impl System {
    /// Whether it is a peer router (not pd-proxy).
    pub fn is_peer(&self) -> bool {
        !matches!(self.front, Front::PdProxy(_))
    }

    /// Starts the peer in front of every engine of `cluster` (none for pd-proxy, which the
    /// cluster started), its log in `dir`.
    pub async fn start_peer(
        &self,
        cluster: &Cluster,
        dir: &Path,
        venv: Option<&Path>,
    ) -> Result<Option<Process>, String> {
        let (program, mut args, ready) = match self.front {
            Front::PdProxy(_) => return Ok(None),
            Front::VllmRouter => (
                "vllm-router",
                words("--vllm-pd-disaggregation --kv-connector mooncake"),
                "/health",
            ),
            Front::Smg => ("smg", words("launch --pd-disaggregation"), "/readiness"),
        };
        let venv = venv.ok_or("the peers need --peers-venv")?;
        let (port, metrics_port) = (free_port(), free_port());
        args.extend(words(&format!("--host 127.0.0.1 --port {port}")));
        for (prefill, bootstrap) in cluster.prefills.iter().zip(&cluster.bootstraps) {
            let bootstrap_port = bootstrap.url.rsplit(':').next().unwrap_or_default();
            args.extend([
                "--prefill".into(),
                prefill.url.clone(),
                bootstrap_port.into(),
            ]);
        }
        for decode in &cluster.decodes {
            args.extend(["--decode".into(), decode.url.clone()]);
        }
        // vllm-router refuses power-of-two over one decode; with one, every policy is the same.
        let decode_policy = if cluster.decodes.len() >= 2 {
            "power_of_two"
        } else {
            "round_robin"
        };
        args.extend(words(&format!(
            "--prefill-policy cache_aware --decode-policy {decode_policy}"
        )));
        args.extend(match self.front {
            Front::Smg => words(&format!(
                "--prometheus-host 127.0.0.1 --prometheus-port {metrics_port} --log-level warn \
                 --shutdown-grace-period-secs 0"
            )),
            _ => words(&format!(
                "--log-level error --prometheus-port {metrics_port} \
                 --worker-startup-check-interval 1"
            )),
        });
        let program = venv.join("bin").join(program);
        launch(dir, self.name, &program, &args, port, ready)
            .await
            .map(Some)
    }
}

fn words(text: &str) -> Vec<String> {
    text.split_whitespace().map(str::to_owned).collect()
}
