//! `pd-cluster`: a whole P/D deployment on 127.0.0.1 answering real OpenAI requests.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use pd_examples::cluster::{Cluster, ClusterSpec};
use pd_examples::openai_client::send;
use pd_service::{init_logging, shutdown_signal, LogFormat};
use pd_transfer::Transport;
use serde_json::json;

/// Start two bootstrap servers, two prefill engines (dp=2,tp=2 and dp=1,tp=2), two decode
/// engines and the proxy; send a few requests; run until Ctrl-C.
#[derive(Debug, Parser)]
#[command(name = "pd-cluster", version, about)]
struct Args {
    /// Exit after the demo requests instead of running until Ctrl-C.
    #[arg(long)]
    once: bool,
    /// The proxy's port.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The folder holding the binaries (default: this program's folder).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Where logs and databases go (default: a fresh temporary folder).
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
}

async fn demo(proxy: &str) -> Result<(), String> {
    let http = reqwest::Client::new();
    let prompt = "Explain in one sentence why prefill and decode run on separate GPUs in disaggregated serving";
    let requests = [
        (
            "completions, whole",
            "/v1/completions",
            json!({"model": "sim-model", "prompt": prompt, "max_tokens": 12}),
        ),
        (
            "completions, streamed",
            "/v1/completions",
            json!({"model": "sim-model", "prompt": prompt, "max_tokens": 12, "stream": true}),
        ),
        (
            "chat, whole",
            "/v1/chat/completions",
            json!({"model": "sim-model", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}),
        ),
        (
            "chat, streamed",
            "/v1/chat/completions",
            json!({"model": "sim-model", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}}),
        ),
    ];
    println!(
        "\nSending {} requests through the proxy at {proxy}:",
        requests.len()
    );
    for (label, path, body) in requests {
        let answer = send(
            &http,
            &format!("{proxy}{path}"),
            &body,
            Duration::from_secs(30),
        )
        .await?;
        if answer.status != 200 {
            return Err(format!("{label}: HTTP {}: {}", answer.status, answer.text));
        }
        println!(
            "  {label:<22} TTFT {:>6.1} ms  total {:>6.1} ms  ->{}",
            answer.ttft.as_secs_f64() * 1e3,
            answer.total.as_secs_f64() * 1e3,
            answer.text
        );
    }
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    init_logging(LogFormat::Text);
    let bin_dir = args.bin_dir.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("."))
    });
    let temp = tempfile::Builder::new().prefix("pd-cluster-").tempdir();
    let run_dir = match (&args.run_dir, &temp) {
        (Some(dir), _) => dir.clone(),
        (None, Ok(temp)) => temp.path().to_path_buf(),
        (None, Err(err)) => {
            eprintln!("error: cannot create a temporary folder: {err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let mut spec = ClusterSpec::demo(bin_dir, run_dir.clone());
    spec.proxy_port = args.port;
    spec.prefill_us_per_token = args.prefill_us_per_token;
    spec.decode_ms_per_token = args.decode_ms_per_token;
    spec.transfer = args.transfer;
    spec.lease_ttl = (args.lease_ttl > 0).then_some(args.lease_ttl);
    if !args.transfer.is_built() {
        eprintln!(
            "error: --transfer {} needs pd-cluster and sim-engine built with `--features ucx` \
             (examples/local-cluster.sh --transfer ucx does that)",
            args.transfer
        );
        return std::process::ExitCode::FAILURE;
    }
    println!(
        "Starting the local P/D cluster, KV over {} (logs in {})",
        args.transfer,
        run_dir.display()
    );
    let cluster = match Cluster::start(&spec).await {
        Ok(cluster) => cluster,
        Err(err) => {
            eprintln!("error: {err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    for (i, (prefill, bootstrap)) in cluster.prefills.iter().zip(&cluster.bootstraps).enumerate() {
        let shape = spec.prefills[i];
        println!(
            "  prefill-{i}: {} (dp={}, tp={}), bootstrap server {}",
            prefill.url, shape.dp, shape.tp, bootstrap.url
        );
    }
    for decode in &cluster.decodes {
        println!("  {}: {}", decode.name, decode.url);
    }
    println!("  proxy: {}", cluster.proxy.url);
    let outcome = demo(&cluster.proxy.url).await;
    if let Err(err) = &outcome {
        eprintln!("error: {err}");
    } else if !args.once {
        println!(
            "\nThe cluster is running. Try:\n  curl {}/v1/completions -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"sim-model\", \"prompt\": \"hello\", \"max_tokens\": 8, \"stream\": true}}'\nPress Ctrl-C to stop.",
            cluster.proxy.url
        );
        shutdown_signal().await;
    }
    println!("Stopping the cluster...");
    cluster.shutdown().await;
    if outcome.is_ok() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
