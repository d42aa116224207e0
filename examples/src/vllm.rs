//! Real vLLM engines in the local cluster: the Python environment and the tiny model they run
//! (`examples/vllm/cpu/`), and the command line and environment of a prefill or decode engine
//! with the Mooncake or NIXL connector, on 127.0.0.1.
//!
//! On a host without an accelerator the engines run vLLM's CPU build on a random-weight model
//! made by `make_model.py`; with `--model` and `--python` the same cluster runs any model with
//! any vLLM installation (docs/real-engines.md).

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::ValueEnum;

use crate::cluster::ClusterError;
use crate::process::{spawn_with_env, wait_for, Process};

/// The folder of the CPU environment's scripts and the connector adapter.
pub const CPU_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/vllm/cpu");

/// How long a vLLM engine may take to answer `/health` (imports alone take 20 to 60 s on two
/// busy cores).
pub const ENGINE_START_TIMEOUT: Duration = Duration::from_secs(420);

/// How long an engine is given to stop after SIGTERM before its process group is killed.
pub const ENGINE_STOP_GRACE: Duration = Duration::from_secs(10);

/// The name the tiny model is served under.
pub const TINY_MODEL_NAME: &str = "tiny";

/// The KV connector P and D use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Connector {
    /// vLLM's MooncakeConnector over TCP: P registers with bootstrap-server, D pulls from P;
    /// the proxy calls P and D at once.
    Mooncake,
    /// vLLM's NixlConnector with CPU buffers: the proxy calls P, then D with P's
    /// `kv_transfer_params` (`--mode sequential`); no bootstrap server is involved.
    Nixl,
}

impl Connector {
    /// vLLM's class name of the connector (`kv_connector`).
    pub fn class_name(self) -> &'static str {
        match self {
            Connector::Mooncake => "MooncakeConnector",
            Connector::Nixl => "NixlConnector",
        }
    }
}

impl std::fmt::Display for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value = self.to_possible_value().expect("no variant is skipped");
        f.write_str(value.get_name())
    }
}

/// Whether an engine prefills, decodes, or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineRole {
    /// The prefill (P) engine: `kv_producer`.
    Prefill,
    /// The decode (D) engine: `kv_consumer`.
    Decode,
    /// Either, request by request: `kv_both`, registered with its bootstrap server as a
    /// prefill is (pd-proxy's `--dual`).
    Both,
}

/// What every real engine of a cluster runs: the interpreter, the model, the connector.
#[derive(Debug, Clone)]
pub struct VllmEngines {
    /// A Python with vLLM installed.
    pub python: PathBuf,
    /// The model folder (or a name the installation can load).
    pub model: String,
    /// The name it is served under (what requests put in `model`).
    pub served_name: String,
    /// The KV connector.
    pub connector: Connector,
    /// Add the small-host settings (float32, eager, 256 tokens, 4 sequences, 1 GiB of KV on
    /// CPU, one OpenMP thread): right for the tiny model, wrong for a real one.
    pub small_host: bool,
    /// Load the MooncakeConnector through `pd_cpu_mooncake` (needed on CPU by vLLM 0.32.0).
    pub mooncake_adapter: bool,
    /// Publish KV cache events (`--kv-events-config`: ZMQ PUB and replay sockets on free
    /// ports, topic `kv`), which vLLM then lists at `GET /kv_event_sources`. vLLM binds only
    /// wildcard endpoints (`tcp://*:PORT`, all interfaces); any other it connects to.
    pub kv_events: bool,
    /// More arguments for every engine.
    pub extra_args: Vec<String>,
    /// Export the engines' traces to this OTLP/HTTP traces endpoint (`--otlp-traces-endpoint`,
    /// protocol `http/protobuf`): vLLM continues the `traceparent` a request brings.
    pub otlp_traces: Option<String>,
    /// Serve HTTPS requiring client certificates (vLLM's `--ssl-*` flags), with these files.
    pub tls: Option<crate::cluster::ClusterTls>,
    /// The GPUs the engines get, one each in turn (see [`VllmEngines::gpu_of`]); empty: every
    /// engine sees every GPU.
    pub gpus: Vec<String>,
    /// The Mooncake transfer engine's protocol: `tcp`, or `rdma` where the hosts have it.
    pub mooncake_protocol: String,
}

/// The Python of the pinned CPU environment, made by `venv.sh` in its cache folder if missing
/// (the first time downloads about 3 GB).
pub async fn cpu_python() -> Result<PathBuf, ClusterError> {
    let venv = run_script(
        "venv.sh",
        Path::new("bash"),
        &[format!("{CPU_DIR}/venv.sh")],
    )
    .await?;
    Ok(PathBuf::from(venv.trim()).join("bin/python"))
}

/// The tiny model, made by `make_model.py` with `python` into `run_dir/tiny-model` unless it
/// is there; returns its folder.
pub async fn tiny_model(python: &Path, run_dir: &Path) -> Result<String, ClusterError> {
    let model = run_dir.join("tiny-model");
    if !model.join("config.json").is_file() {
        let args = [
            format!("{CPU_DIR}/make_model.py"),
            model.display().to_string(),
        ];
        run_script("make_model.py", python, &args).await?;
    }
    Ok(model.display().to_string())
}

impl VllmEngines {
    /// Engines of `model` run by `python` and served as `served_name`, with the small-host
    /// settings and the Mooncake adapter (the adapter changes nothing where an accelerator is).
    pub fn new(python: PathBuf, model: String, served_name: String, connector: Connector) -> Self {
        VllmEngines {
            python,
            model,
            served_name,
            connector,
            small_host: true,
            mooncake_adapter: true,
            kv_events: false,
            extra_args: Vec::new(),
            otlp_traces: None,
            tls: None,
            gpus: Vec::new(),
            mooncake_protocol: "tcp".to_owned(),
        }
    }

    /// The GPU of the engine started `nth` (prefills first, then decodes), when `gpus` are
    /// given: the list in turn, so that P and D get their own devices while there are enough.
    pub fn gpu_of(&self, nth: usize) -> Option<&str> {
        (!self.gpus.is_empty()).then(|| self.gpus[nth % self.gpus.len()].as_str())
    }

    /// The CPU setup this repository tests: [`cpu_python`] and [`tiny_model`].
    pub async fn cpu(run_dir: &Path, connector: Connector) -> Result<Self, ClusterError> {
        let python = cpu_python().await?;
        let model = tiny_model(&python, run_dir).await?;
        Ok(VllmEngines::new(
            python,
            model,
            TINY_MODEL_NAME.into(),
            connector,
        ))
    }

    /// The `--kv-transfer-config` of an engine.
    pub fn kv_transfer_config(&self, role: EngineRole, bootstrap: Option<&str>) -> String {
        let config = match self.connector {
            Connector::Mooncake => {
                let mut extra = serde_json::json!({"mooncake_protocol": self.mooncake_protocol});
                if let Some(bootstrap) = bootstrap {
                    extra["bootstrap_server_address"] = bootstrap
                        .trim_start_matches("http://")
                        .trim_end_matches('/')
                        .into();
                }
                let mut config = serde_json::json!({
                    "kv_connector": self.connector.class_name(),
                    "kv_role": match role {
                        EngineRole::Prefill => "kv_producer",
                        EngineRole::Decode => "kv_consumer",
                        EngineRole::Both => "kv_both",
                    },
                    "kv_connector_extra_config": extra,
                });
                if self.mooncake_adapter {
                    config["kv_connector_module_path"] = "pd_cpu_mooncake".into();
                }
                config
            }
            Connector::Nixl => serde_json::json!({
                "kv_connector": self.connector.class_name(),
                "kv_role": "kv_both",
                "kv_buffer_device": "cpu",
            }),
        };
        config.to_string()
    }

    /// Starts one engine serving on `port` (its log in `run_dir/<name>.log`), in a process
    /// group of its own so that stopping it stops vLLM's engine-core and worker processes too.
    /// `bootstrap` is the bootstrap server a Mooncake prefill registers with; `side_channel`
    /// a free port for NIXL's handshake; `gpu`, when given, the one GPU it sees
    /// (`CUDA_VISIBLE_DEVICES`, see [`VllmEngines::gpu_of`]).
    #[allow(clippy::too_many_arguments)]
    pub fn spawn(
        &self,
        run_dir: &Path,
        name: &str,
        role: EngineRole,
        port: u16,
        bootstrap: Option<&str>,
        side_channel: u16,
        gpu: Option<&str>,
    ) -> Result<Process, ClusterError> {
        let mut args: Vec<String> = [
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            &self.model,
            "--served-model-name",
            &self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--seed",
            "0",
            "--kv-transfer-config",
            &self.kv_transfer_config(role, bootstrap),
        ]
        .map(String::from)
        .to_vec();
        if self.small_host {
            args.extend(
                [
                    "--dtype",
                    "float32",
                    "--enforce-eager",
                    "--max-model-len",
                    "256",
                    "--max-num-seqs",
                    "4",
                    "--block-size",
                    "32",
                ]
                .map(String::from),
            );
        }
        if self.kv_events {
            let events = serde_json::json!({
                "enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv",
                "endpoint": format!("tcp://*:{}", crate::process::free_port()),
                "replay_endpoint": format!("tcp://*:{}", crate::process::free_port()),
            });
            args.extend(["--kv-events-config".to_owned(), events.to_string()]);
        }
        args.extend(self.extra_args.iter().cloned());
        let url = match &self.tls {
            Some(tls) => {
                args.extend(tls.vllm_args());
                crate::cluster::ClusterTls::url(port)
            }
            None => format!("http://127.0.0.1:{port}"),
        };
        if let Some(endpoint) = &self.otlp_traces {
            args.extend(["--otlp-traces-endpoint".to_owned(), endpoint.clone()]);
        }
        let side_channel = side_channel.to_string();
        let mut env = vec![
            // sitecustomize.py there: vLLM's engine core and worker die with their parent.
            ("PYTHONPATH", CPU_DIR),
            ("PD_DIE_WITH_PARENT", "1"),
            ("VLLM_HOST_IP", "127.0.0.1"),
            ("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"),
            ("VLLM_NIXL_SIDE_CHANNEL_PORT", &side_channel),
            ("VLLM_NO_USAGE_STATS", "1"),
            ("DO_NOT_TRACK", "1"),
            ("HF_HUB_OFFLINE", "1"),
            // vLLM's own log lines carry the request ids the tests look for.
            ("VLLM_LOGGING_LEVEL", "INFO"),
        ];
        if self.otlp_traces.is_some() {
            // vLLM's default is gRPC; spans leave in batches every 200 ms.
            env.extend([
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
                ("OTEL_BSP_SCHEDULE_DELAY", "200"),
                ("OTEL_SERVICE_NAME", name),
            ]);
        }
        if let Some(gpu) = gpu {
            env.push(("CUDA_VISIBLE_DEVICES", gpu));
        }
        if self.small_host {
            env.extend([
                ("VLLM_CPU_KVCACHE_SPACE", "1"),
                ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                ("OMP_NUM_THREADS", "1"),
            ]);
        }
        let mut process = spawn_with_env(run_dir, name, &self.python, &args, &env, url)?;
        process.stop_grace = ENGINE_STOP_GRACE;
        if let Some(tls) = &self.tls {
            process.client_tls = tls.caller();
        }
        Ok(process)
    }
}

/// Waits for a vLLM engine's `/health`, within [`ENGINE_START_TIMEOUT`].
pub async fn wait_ready(engine: &mut Process) -> Result<(), ClusterError> {
    wait_for(engine, "/health", ENGINE_START_TIMEOUT).await
}

/// Runs a preparation step to its end and returns what it printed; a failure names the step
/// and carries the tail of what it wrote to stderr.
async fn run_script(step: &str, program: &Path, args: &[String]) -> Result<String, ClusterError> {
    let output = tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    // The environment's first install downloads about 3 GB.
    let output = tokio::time::timeout(Duration::from_secs(1800), output)
        .await
        .map_err(|_| ClusterError::Prepare {
            step: step.to_owned(),
            reason: "did not finish within 30 minutes".to_owned(),
        })?
        .map_err(|source| ClusterError::Spawn {
            name: step.to_owned(),
            source,
        })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(ClusterError::Prepare {
            step: step.to_owned(),
            reason: format!("{}:\n{}", output.status, crate::process::tail(&stderr, 30)),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::free_port;
    use std::os::unix::fs::PermissionsExt;

    #[tokio::test]
    async fn with_gpus_each_engine_sees_only_its_own() {
        let dir = tempfile::tempdir().unwrap();
        // A stand-in for vLLM's Python that says which GPUs it was given.
        let python = dir.path().join("python");
        std::fs::write(
            &python,
            "#!/bin/sh\necho \"gpus=[$CUDA_VISIBLE_DEVICES]\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut engines = VllmEngines::new(python, "m".into(), "m".into(), Connector::Mooncake);
        assert_eq!(engines.gpu_of(0), None);
        engines.gpus = vec!["2".into(), "3".into()];
        // P and D on their own devices; a third engine shares the first's.
        assert_eq!(
            (0..3).map(|nth| engines.gpu_of(nth)).collect::<Vec<_>>(),
            [Some("2"), Some("3"), Some("2")]
        );
        for (nth, name, role) in [
            (0, "prefill-0", EngineRole::Prefill),
            (1, "decode-0", EngineRole::Decode),
        ] {
            let gpu = engines.gpu_of(nth);
            let mut engine = engines
                .spawn(dir.path(), name, role, free_port(), None, free_port(), gpu)
                .unwrap();
            let expected = format!("gpus=[{}]", gpu.unwrap());
            let mut said = String::new();
            for _ in 0..100 {
                said = std::fs::read_to_string(&engine.log).unwrap_or_default();
                if said.contains("gpus=") {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(said.contains(&expected), "{name}: {said}");
            engine.kill().await;
        }
    }

    #[test]
    fn the_mooncake_protocol_and_registry_reach_the_connector_config() {
        let mut engines =
            VllmEngines::new("python".into(), "m".into(), "m".into(), Connector::Mooncake);
        engines.mooncake_protocol = "rdma".to_owned();
        let config: serde_json::Value = serde_json::from_str(
            &engines.kv_transfer_config(EngineRole::Prefill, Some("http://10.0.0.5:8998/")),
        )
        .unwrap();
        let extra = &config["kv_connector_extra_config"];
        assert_eq!(extra["mooncake_protocol"], "rdma");
        // host:port, no scheme: vLLM splits it on ':'.
        assert_eq!(extra["bootstrap_server_address"], "10.0.0.5:8998");
        assert_eq!(config["kv_role"], "kv_producer");
    }
}
