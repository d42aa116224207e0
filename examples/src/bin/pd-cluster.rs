//! `pd-cluster`: a whole P/D deployment on 127.0.0.1 answering real OpenAI requests.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use pd_examples::cluster::{
    demo, Cluster, ClusterSpec, ClusterTls, GatewaySpec, PrefillShape, ServedModel,
};
use pd_examples::sim::Dialect;
use pd_examples::vllm::{self, Connector, VllmEngines};
use pd_service::{init_logging, shutdown_signal, LogFormat};
use pd_transfer::Transport;

/// Start a local P/D cluster on 127.0.0.1 from the release binaries beside this one: two
/// bootstrap servers, two simulated prefill engines (dp=2,tp=2 and dp=1,tp=2) registering under
/// leases (vLLM) or over `PUT /route` (SGLang), two simulated decode engines and pd-proxy; or,
/// with `--engine vllm`, one bootstrap server and real vLLM prefill and decode engines (vLLM's
/// CPU build and a tiny model made here, unless `--vllm-python`/`--model` say otherwise). Send
/// requests through the proxy (completions and chat, whole and streamed, and with SGLang
/// `/generate`; simulated decodes pull and verify the KV); then run until
/// Ctrl-C (or exit with --once). Exits non-zero when a port is taken, a process fails to start,
/// or a request fails. The processes die with this one; logs stay in the run folder.
#[derive(Debug, Parser)]
#[command(name = "pd-cluster", version, about)]
struct Args {
    /// Exit after the demo requests instead of running until Ctrl-C.
    #[arg(long)]
    once: bool,
    /// The proxy's port (checked free before anything starts).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Give the other processes consecutive ports from this one, each checked free before
    /// anything starts (default: free ephemeral ports).
    #[arg(long)]
    base_port: Option<u16>,
    /// Remove the run folder (logs, databases) on exit; by default it is kept and its path
    /// printed.
    #[arg(long)]
    clean: bool,
    /// The folder holding the binaries (default: this program's folder).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Where logs and databases go (default: a new folder under the system's temporary folder).
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Simulated prefill time per prompt token, in µs.
    #[arg(long, default_value_t = 500)]
    prefill_us_per_token: u64,
    /// Simulated decode time per token, in ms.
    #[arg(long, default_value_t = 10)]
    decode_ms_per_token: u64,
    /// The KV transport: tcp, or ucx (one-sided over shared memory; `UCX_TLS` defaults to
    /// posix,sysv,self; needs a build with `--features ucx`).
    #[arg(long, value_enum, default_value_t = Transport::Tcp)]
    transfer: Transport,
    /// Seconds of the leases the prefill workers register under (a killed prefill leaves the
    /// registry this long after its last keepalive); 0 registers without leases.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=86_400))]
    lease_ttl: u32,
    /// Which engines to run: sim (sim-engine on vLLM's Mooncake wire, the proxy's concurrent
    /// mode), sim-sglang (sim-engine on SGLang's wire: prefill ranks on `PUT /route`, the proxy's
    /// SGLang mode, `/generate` served too, no leases), or vllm (real vLLM engines: one prefill,
    /// one decode; see --connector, --model, --vllm-python).
    #[arg(long, value_enum, default_value_t = EngineKind::Sim)]
    engine: EngineKind,
    /// With --engine vllm: the KV connector, mooncake (over TCP, P registered with the
    /// bootstrap server, the proxy's concurrent mode) or nixl (CPU buffers, the proxy's
    /// sequential mode; slow to start and busy while idle on CPU).
    #[arg(long, value_enum, default_value_t = Connector::Mooncake)]
    connector: Connector,
    /// With --engine vllm: the model to serve (a folder or a name vLLM can load), instead of
    /// the tiny random-weight model made in the run folder. Drops the small-host settings.
    #[arg(long)]
    model: Option<String>,
    /// With --engine vllm: a Python with vLLM (and the connector's transfer engine) installed,
    /// instead of the pinned CPU environment examples/vllm/cpu/venv.sh makes.
    #[arg(long, value_name = "PYTHON")]
    vllm_python: Option<PathBuf>,
    /// With --engine vllm on a GPU host: the GPUs to use (comma-separated indexes), one per
    /// engine in turn, prefills first, each engine seeing only its own
    /// (`CUDA_VISIBLE_DEVICES`): `--gpus 0,1` puts P on GPU 0 and D on GPU 1. More engines
    /// than GPUs share them in turn. Without it every engine sees every GPU. Needs
    /// --vllm-python (a GPU build of vLLM).
    #[arg(long, value_delimiter = ',', value_name = "INDEXES")]
    gpus: Vec<String>,
    /// With --engine vllm --connector mooncake: the transfer engine's protocol, tcp or rdma
    /// (RDMA NICs and a Mooncake build with them, as on a GPU host).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "rdma"])]
    mooncake_protocol: String,
    /// With --engine vllm: one more argument for every engine (repeatable), e.g.
    /// `--engine-arg=--tensor-parallel-size=2`.
    #[arg(long, allow_hyphen_values = true)]
    engine_arg: Vec<String>,
    /// How the proxy places requests (its --policy): precise_prefix routes on the engines' own
    /// KV cache events, which every engine publishes unless --no-kv-events.
    #[arg(long, default_value = "precise_prefix")]
    policy: String,
    /// Engines do not publish their KV cache events and the proxy does not follow them (then
    /// precise_prefix falls back to cache_aware).
    #[arg(long)]
    no_kv_events: bool,
    /// One more argument for the proxy (repeatable), e.g. `--proxy-arg=--kv-load-weight=2`.
    #[arg(long, allow_hyphen_values = true)]
    proxy_arg: Vec<String>,
    /// How many models the simulated engines serve: with more than one, every model gets its
    /// own prefills and decodes (the shape above, over again) serving `sim-model-<k>`, all behind
    /// the proxy (which routes by `model`), and model 0's engines load the LoRA adapters
    /// `sim-lora-a` and `sim-lora-b` (vLLM's wire; more load at run time). One model with
    /// --engine vllm.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    models: u16,
    /// The proxy finds the engines through DNS, as on Kubernetes: a dnsmasq on 127.0.0.1
    /// (Debian: dnsmasq-base) publishes SRV records of the prefills, their bootstrap servers and
    /// the decodes, and the proxy gets `dns://` names instead of URLs. Simulated engines only.
    #[arg(long)]
    dns: bool,
    /// An elastic fleet: the prefills serve both roles (vLLM's kv_both, simulated), the proxy
    /// splits them between prefill and decode duty (`--dual`), and with `--proxy-arg`s of the
    /// capacity planner (`--planner-ttft-target`, `--planner-tpot-target`) the split follows
    /// the load. Four such engines (dp=1, tp=1) and no decode-only one. Simulated vLLM
    /// engines, found by URL.
    #[arg(long)]
    dual: bool,
    /// Put a gateway in front instead of pd-proxy: `envoy` runs Envoy as the front door with
    /// pd-epp as its endpoint picker (the Gateway API Inference Extension's protocol) and a
    /// pd-proxy sidecar beside each decode for P/D. Needs --envoy (local-cluster.sh installs
    /// Envoy and passes it).
    #[arg(long, value_enum)]
    gateway: Option<GatewayKind>,
    /// The Envoy binary of --gateway envoy (examples/gateway/tools.sh prints it).
    #[arg(long, value_name = "PATH", env = "PD_CLUSTER_ENVOY")]
    envoy: Option<PathBuf>,
    /// Register the prefill workers from Python through the pd_bootstrap package: this
    /// interpreter (which must have the package) runs examples/python/register_engine.py beside
    /// each prefill engine, under leases of --lease-ttl (10 if 0). vLLM only.
    #[arg(long, value_name = "PYTHON")]
    register_with_python: Option<PathBuf>,
    /// Every listener speaks HTTPS with certificates of a CA made for the run (in
    /// `<run-dir>/tls`): the proxy, the engines (requiring client certificates, as vLLM's
    /// `--ssl-cert-reqs 2`), the bootstrap servers of simulated engines (letting writers in by
    /// their client certificates). Not with --dns, --gateway or --register-with-python.
    #[arg(long)]
    tls: bool,
    /// The proxy's --api-key, which the demo's requests then send (tenants of their own come
    /// with --proxy-arg=--api-keys-file=FILE).
    #[arg(long, env = "PD_CLUSTER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
}

/// The gateways `--gateway` can put in front.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum GatewayKind {
    /// Envoy with pd-epp (ext_proc) and pd-proxy sidecars.
    Envoy,
}

/// The engines `--engine` chooses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum EngineKind {
    /// sim-engine playing vLLM with the Mooncake connector.
    Sim,
    /// sim-engine playing SGLang.
    #[value(alias = "sglang")]
    SimSglang,
    /// Real vLLM engines.
    Vllm,
}

impl EngineKind {
    /// Whose wire the engines speak.
    fn dialect(self) -> Dialect {
        match self {
            EngineKind::SimSglang => Dialect::Sglang,
            EngineKind::Sim | EngineKind::Vllm => Dialect::Vllm,
        }
    }
}

/// The real engines of `--engine vllm`: the pinned CPU environment and the tiny model, or the
/// caller's Python and model.
async fn vllm_engines(args: &Args, run_dir: &std::path::Path) -> Result<VllmEngines, String> {
    let python = match &args.vllm_python {
        Some(python) => python.clone(),
        None => {
            println!("Preparing vLLM's CPU environment (the first time downloads about 3 GB)...");
            vllm::cpu_python().await.map_err(|err| err.to_string())?
        }
    };
    let (model, served_name) = match &args.model {
        Some(model) => (model.clone(), model.clone()),
        None => {
            let tiny = vllm::tiny_model(&python, run_dir)
                .await
                .map_err(|err| err.to_string())?;
            (tiny, vllm::TINY_MODEL_NAME.to_owned())
        }
    };
    let mut engines = VllmEngines::new(python, model, served_name, args.connector);
    engines.small_host = args.model.is_none();
    engines.kv_events = !args.no_kv_events;
    engines.extra_args = args.engine_arg.clone();
    engines.gpus = args.gpus.clone();
    engines.mooncake_protocol = args.mooncake_protocol.clone();
    Ok(engines)
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let _logging = init_logging(LogFormat::Text);
    if !args.transfer.is_built() {
        eprintln!(
            "error: --transfer {} needs pd-cluster and sim-engine built with `--features ucx` \
             (examples/local-cluster.sh --transfer ucx does that)",
            args.transfer
        );
        return std::process::ExitCode::FAILURE;
    }
    if !args.gpus.is_empty() && args.engine != EngineKind::Vllm {
        eprintln!("error: --gpus places real vLLM engines: it needs --engine vllm");
        return std::process::ExitCode::FAILURE;
    }
    if !args.gpus.is_empty() && args.vllm_python.is_none() {
        eprintln!(
            "error: --gpus needs --vllm-python, a Python with a GPU build of vLLM (the pinned \
             environment examples/vllm/cpu/venv.sh makes is vLLM's CPU build)"
        );
        return std::process::ExitCode::FAILURE;
    }
    if let Some(bad) = args.gpus.iter().find(|gpu| gpu.parse::<u32>().is_err()) {
        eprintln!("error: --gpus takes GPU indexes (0,1,...), not {bad:?}");
        return std::process::ExitCode::FAILURE;
    }
    if args.models > 1 && args.engine == EngineKind::Vllm {
        eprintln!("error: --models needs simulated engines: --engine vllm serves one model");
        return std::process::ExitCode::FAILURE;
    }
    if args.register_with_python.is_some() && args.engine != EngineKind::Sim {
        eprintln!(
            "error: --register-with-python registers simulated vLLM workers: it needs --engine sim"
        );
        return std::process::ExitCode::FAILURE;
    }
    let bin_dir = args.bin_dir.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("."))
    });
    let run_dir = match &args.run_dir {
        Some(dir) => dir.clone(),
        None => match tempfile::Builder::new().prefix("pd-cluster-").tempdir() {
            Ok(temp) => temp.keep(),
            Err(err) => {
                eprintln!("error: cannot create a temporary folder: {err}");
                return std::process::ExitCode::FAILURE;
            }
        },
    };
    let mut spec = ClusterSpec::demo(bin_dir, run_dir.clone());
    spec.proxy_port = args.port;
    spec.base_port = args.base_port;
    spec.prefill_us_per_token = args.prefill_us_per_token;
    spec.decode_ms_per_token = args.decode_ms_per_token;
    spec.transfer = args.transfer;
    spec.lease_ttl = (args.lease_ttl > 0).then_some(args.lease_ttl);
    spec.dialect = args.engine.dialect();
    spec.python_registrar = args.register_with_python.clone();
    spec.kv_events = !args.no_kv_events;
    spec.models = usize::from(args.models);
    spec.dns = args.dns;
    spec.dual = args.dual;
    if args.dual {
        spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; 4];
        spec.decodes = 0;
    }
    if args.tls {
        match ClusterTls::make(&run_dir) {
            Ok(tls) => spec.tls = Some(tls),
            Err(err) => {
                eprintln!("error: {err}");
                return std::process::ExitCode::FAILURE;
            }
        }
    }
    spec.proxy_args = vec!["--policy".to_owned(), args.policy.clone()];
    spec.proxy_args.extend(args.proxy_arg.iter().cloned());
    if let Some(key) = &args.api_key {
        spec.proxy_args
            .extend(["--api-key".to_owned(), key.clone()]);
    }
    if let Some(GatewayKind::Envoy) = args.gateway {
        let Some(envoy) = args.envoy.clone() else {
            eprintln!("error: --gateway envoy needs --envoy PATH (examples/gateway/tools.sh prints it; local-cluster.sh passes it)");
            return std::process::ExitCode::from(2);
        };
        spec.gateway = Some(GatewaySpec {
            envoy,
            fail_open: false,
            buffered: false,
            picker_timeout: Duration::from_secs(5),
            epp_args: vec!["--policy".to_owned(), args.policy.clone()],
        });
    }
    if args.engine == EngineKind::Vllm {
        match vllm_engines(&args, &run_dir).await {
            Ok(engines) => spec.vllm = Some(engines),
            Err(err) => {
                eprintln!("error: {err}");
                return std::process::ExitCode::FAILURE;
            }
        }
        spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
        spec.decodes = 1;
    }
    let kv = match args.engine {
        EngineKind::Vllm => format!("vLLM's {}", args.connector.class_name()),
        _ => args.transfer.to_string(),
    };
    println!(
        "Starting the local P/D cluster ({} engines), KV over {kv} (logs in {})",
        args.engine
            .to_possible_value()
            .expect("no variant is skipped")
            .get_name(),
        run_dir.display()
    );
    let cluster = match Cluster::start(&spec).await {
        Ok(cluster) => cluster,
        Err(err) => {
            // The error names a log in the run folder: keep it, even with --clean.
            eprintln!("error: {err}");
            finish_run_dir(&run_dir, false);
            return std::process::ExitCode::FAILURE;
        }
    };
    describe(&cluster, &spec, &args.policy);
    let key = args.api_key.as_deref();
    let outcome = demo::run(&cluster.proxy, key, spec.dialect, cluster.models()).await;
    let model = cluster.models().first().map_or("", |m| m.name.as_str());
    if let Err(err) = &outcome {
        eprintln!("error: {err}");
    } else if !args.once {
        // Listen before saying so: a SIGTERM right after the message must stop us gracefully.
        let stop = shutdown_signal();
        let ca = (spec.tls.as_ref())
            .map_or_else(String::new, |tls| format!(" --cacert {}", tls.ca.display()));
        println!(
            "\nThe cluster is running. Try:\n  curl{ca} {}/v1/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{model}\", \"prompt\": \"hello\", \"max_tokens\": 8, \"stream\": true}}'\nPress Ctrl-C to stop.",
            cluster.proxy.url
        );
        stop.await;
    }
    println!("Stopping the cluster...");
    let stopping = std::time::Instant::now();
    cluster.shutdown().await;
    println!("Stopped in {:?}.", stopping.elapsed());
    finish_run_dir(&run_dir, args.clean);
    if outcome.is_ok() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

/// Prints where everything of `cluster` (started from `spec`, placing with `policy`) runs.
fn describe(cluster: &Cluster, spec: &ClusterSpec, policy: &str) {
    let shapes = spec.prefills.iter().cycle();
    let prefills = cluster.prefills.iter().zip(&cluster.bootstraps).zip(shapes);
    for (i, ((prefill, bootstrap), shape)) in prefills.enumerate() {
        println!(
            "  prefill-{i}: {} (dp={}, tp={}), bootstrap server {} (one per prefill \
             deployment, as on its rank 0)",
            prefill.url, shape.dp, shape.tp, bootstrap.url
        );
    }
    if !cluster.registrars.is_empty() {
        println!("  prefill workers registered from Python (examples/python/register_engine.py)");
    }
    for decode in &cluster.decodes {
        println!("  {}: {}", decode.name, decode.url);
    }
    for model in cluster.models() {
        print_model(model);
    }
    match &cluster.gateway {
        None => {
            println!("  proxy: {} (--policy {})", cluster.proxy.url, policy);
            let registries: Vec<String> = (cluster.bootstraps.iter())
                .map(|bootstrap| format!("{}/ui", bootstrap.url))
                .collect();
            println!(
                "  live pages: {}/ui (the proxy), {} (the bootstrap servers)",
                cluster.proxy.url,
                registries.join(", ")
            );
        }
        Some(gateway) => {
            println!(
                "  gateway: Envoy at {} (admin {})",
                cluster.proxy.url, gateway.envoy_admin
            );
            println!(
                "  endpoint picker: pd-epp at {} (ext_proc; --policy {}), metrics at {}/metrics",
                gateway.epp_grpc, policy, gateway.epp.url
            );
            for (sidecar, decode) in gateway.sidecars.iter().zip(&cluster.decodes) {
                println!(
                    "  {}: {} beside {} (live page {}/ui)",
                    sidecar.name, sidecar.url, decode.name, sidecar.url
                );
            }
        }
    }
    if let Some(dns) = &cluster.dns {
        println!(
            "  DNS: dnsmasq at {} names the engines ({}, {}, {}); the proxy follows them",
            dns.addr,
            pd_examples::cluster::dns::PREFILLS,
            pd_examples::cluster::dns::BOOTSTRAPS,
            pd_examples::cluster::dns::DECODES
        );
    }
    if spec.vllm.as_ref().is_some_and(|vllm| vllm.small_host) {
        println!(
            "  vLLM serves a tiny model made here with random weights: its answers are \
             gibberish, as expected (--model for a real one)"
        );
    }
    if spec.kv_events {
        println!("  KV cache events: every engine publishes, the proxy follows (GET /admin/kv-index with --proxy-arg=--admin-key=KEY)");
    }
}

/// One served model's line: its name, its adapters, its engines.
fn print_model(model: &ServedModel) {
    let adapters = match model.adapters.is_empty() {
        true => String::new(),
        false => format!(
            " with LoRA adapters {} (more load at run time)",
            model.adapters.join(", ")
        ),
    };
    let engines = [&model.prefills[..], &model.decodes[..]].concat().join(" ");
    println!("  model {}{adapters}: {engines}", model.name);
}

/// Keeps the run folder and says where it is, or removes it with `--clean`.
fn finish_run_dir(run_dir: &std::path::Path, clean: bool) {
    if clean {
        if let Err(err) = std::fs::remove_dir_all(run_dir) {
            eprintln!("warning: cannot remove {}: {err}", run_dir.display());
        }
    } else {
        println!("Logs and databases kept in {}", run_dir.display());
    }
}
