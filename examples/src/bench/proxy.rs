//! Proxy scenarios: `POST /v1/completions` through a proxy to instant mock P and D servers
//! ([`super::mocks`]), whole and streamed, against the same mock D called directly (the
//! floor); the delay a proxy adds to D's first chunk; and TTFT of concurrent versus sequential
//! P/D with simulated engines.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::loadgen::{self, LoadConfig, ProcessUsage, RequestFactory};
use super::mocks::Mocks;
use super::report::Row;
use crate::cluster::{free_port, spawn, wait_for, Cluster, ClusterSpec, PrefillShape, Process};
use crate::openai_client::send;

/// The prompt of every request.
const PROMPT: &str = "Summarize the trade-offs of prefill/decode disaggregation for a 70B model served on 16 GPUs, in three sentences, for an infrastructure audience.";

/// The prompt's token ids for the engines' tokenizer (one per byte): what the mock P announces
/// it holds.
pub fn prompt_tokens() -> Vec<u32> {
    PROMPT.bytes().map(u32::from).collect()
}

/// The ~300-byte request body every system is sent.
pub fn request_body(stream: bool) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "model": "sim-model",
        "prompt": PROMPT,
        "max_tokens": 16,
        "temperature": 0.7,
        "top_p": 0.95,
        "stream": stream,
    }))
    .expect("json")
}

/// How to start a proxy in front of one P (with its bootstrap port) and one D.
#[derive(Debug, Clone)]
pub struct ProxyCommand {
    /// The name in the report.
    pub name: String,
    /// The program.
    pub program: PathBuf,
    /// Arguments; `{port}`, `{metrics_port}`, `{prefill}`, `{bootstrap_port}`, `{decode}` and
    /// `{tokenizer}` are replaced.
    pub args: Vec<String>,
    /// The arguments of its plain policy (round robin) ...
    pub plain_policy: Vec<String>,
    /// ... and of its prefix-cache-aware one (pd-proxy: precise_prefix on the engines' KV
    /// events; the peers: their cache_aware).
    pub cache_policy: Vec<String>,
    /// The path that answers 200 once it can route.
    pub ready_path: String,
}

impl ProxyCommand {
    /// pd-proxy from `bin_dir`.
    pub fn pd_proxy(bin_dir: &Path) -> Self {
        let args =
            "--host 127.0.0.1 --port {port} --prefill {prefill} {bootstrap_port} --decode {decode}";
        ProxyCommand {
            name: "pd-proxy".to_owned(),
            program: bin_dir.join("pd-proxy"),
            args: words(args),
            plain_policy: words("--policy round_robin"),
            cache_policy: words("--policy precise_prefix --tokenizer {tokenizer}"),
            ready_path: "/ready".to_owned(),
        }
    }

    /// The peer routers installed in `venv` by `examples/bench/peers.sh`: vllm-router in vLLM
    /// Mooncake mode and smg in its P/D mode (against generic backends it sends to P and D at
    /// once, with SGLang's bootstrap fields), both with round robin and quiet logs.
    pub fn peers(venv: &Path) -> Vec<Self> {
        let peers = [
            (
                "vllm-router",
                "--host 127.0.0.1 --port {port} --vllm-pd-disaggregation --kv-connector mooncake \
                 --prefill {prefill} {bootstrap_port} --decode {decode} \
                 --log-level error --prometheus-port {metrics_port} --worker-startup-check-interval 1",
                "/health",
            ),
            (
                "smg",
                "launch --host 127.0.0.1 --port {port} --pd-disaggregation \
                 --prefill {prefill} {bootstrap_port} --decode {decode} \
                 --prometheus-host 127.0.0.1 --prometheus-port {metrics_port} --log-level warn \
                 --shutdown-grace-period-secs 0",
                "/readiness",
            ),
        ];
        peers
            .into_iter()
            .map(|(name, args, ready_path)| ProxyCommand {
                name: name.to_owned(),
                program: venv.join("bin").join(name),
                args: words(args),
                plain_policy: words("--policy round_robin"),
                cache_policy: words("--policy cache_aware"),
                ready_path: ready_path.to_owned(),
            })
            .collect()
    }

    /// Starts it in front of the mocks, with its cache-aware policy when `cache_aware`.
    async fn start(
        &self,
        run_dir: &Path,
        mocks: &Mocks,
        decode: SocketAddr,
        cache_aware: bool,
    ) -> Result<Process, String> {
        let (prefill, bootstrap) = (mocks.prefill, mocks.bootstrap);
        let (port, metrics_port) = (free_port(), free_port());
        let tokenizer = run_dir.join("tokenizer");
        std::fs::create_dir_all(&tokenizer)
            .and_then(|()| pd_tokenize::byte_level::write(&tokenizer))
            .map_err(|e| format!("{}: {e}", tokenizer.display()))?;
        let policy = match cache_aware {
            true => &self.cache_policy,
            false => &self.plain_policy,
        };
        let args: Vec<String> = (self.args.iter().chain(policy))
            .map(|a| {
                a.replace("{port}", &port.to_string())
                    .replace("{metrics_port}", &metrics_port.to_string())
                    .replace("{prefill}", &format!("http://{prefill}"))
                    .replace("{bootstrap_port}", &bootstrap.port().to_string())
                    .replace("{decode}", &format!("http://{decode}"))
                    .replace("{tokenizer}", &tokenizer.display().to_string())
            })
            .collect();
        launch(
            run_dir,
            &self.name,
            &self.program,
            &args,
            port,
            &self.ready_path,
        )
        .await
    }
}

fn words(text: &str) -> Vec<String> {
    text.split_whitespace().map(str::to_owned).collect()
}

/// Starts a proxy listening on `port` and waits until it has answered a completion.
pub(super) async fn launch(
    run_dir: &Path,
    name: &str,
    program: &Path,
    args: &[String],
    port: u16,
    ready_path: &str,
) -> Result<Process, String> {
    let url = format!("http://127.0.0.1:{port}");
    let mut process = spawn(run_dir, name, program, args, url).map_err(|e| e.to_string())?;
    wait_for(&mut process, ready_path, Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    // Ready routes may answer before the first pair is discovered: send until one succeeds.
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", process.url);
    let body: Value = serde_json::from_slice(&request_body(false)).expect("json");
    for _ in 0..100 {
        if matches!(send(&http, &url, &body, Duration::from_secs(5)).await, Ok(a) if a.status == 200)
        {
            return Ok(process);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "{name} never answered a completion (log: {})",
        process.log.display()
    ))
}

/// `POST /v1/completions` with the benchmark's body, whole or streamed.
pub(super) fn completions(addr: SocketAddr, stream: bool) -> RequestFactory {
    let host = addr.to_string();
    let body = request_body(stream);
    Arc::new(move |_| loadgen::post_json(&host, "/v1/completions", body.clone()))
}

/// Where and how long to run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Scratch folder for logs.
    pub run_dir: PathBuf,
    /// Measured time per run.
    pub duration: Duration,
    /// Concurrency levels.
    pub concurrency: Vec<usize>,
}

/// One system under one workload.
struct Run<'a> {
    scenario: &'a str,
    system: &'a str,
    target: SocketAddr,
    /// The process whose CPU and memory are reported (none for the mocks themselves).
    pid: Option<u32>,
    stream: bool,
    first_byte: bool,
}

async fn measure(settings: &Settings, run: Run<'_>, rows: &mut Vec<Row>) {
    for &concurrency in &settings.concurrency {
        let config = LoadConfig {
            concurrency,
            duration: settings.duration,
            warmup: Duration::from_millis(500),
            first_byte: run.first_byte,
        };
        let before = run.pid.and_then(ProcessUsage::read);
        let report = loadgen::run(run.target, completions(run.target, run.stream), config).await;
        let after = run.pid.and_then(ProcessUsage::read);
        let row = Row::new(
            run.scenario,
            run.system,
            concurrency,
            &report,
            before,
            after,
        );
        eprintln!("{}", row.markdown());
        rows.push(row);
    }
}

/// Whole and streamed completions, directly to D and through each proxy, plus the delay each
/// proxy adds to D's first streamed chunk.
pub async fn throughput(settings: &Settings, proxies: &[ProxyCommand]) -> Result<Vec<Row>, String> {
    let mocks = Mocks::start(prompt_tokens()).await;
    let mut rows = Vec::new();
    // The first-chunk latency needs no high concurrency: at most 16 in flight, each level once.
    let mut capped: Vec<usize> = settings.concurrency.iter().map(|c| (*c).min(16)).collect();
    capped.sort_unstable();
    capped.dedup();
    let first_chunk = Settings {
        concurrency: capped,
        ..settings.clone()
    };
    // (scenario, streamed, first byte timed, D, settings, cache-aware policies)
    let workloads = [
        (
            "completions, whole",
            false,
            false,
            mocks.decode,
            settings,
            false,
        ),
        (
            "completions, streamed (16 events)",
            true,
            false,
            mocks.decode,
            settings,
            false,
        ),
        (
            "first streamed chunk (D pauses 20 ms after it)",
            true,
            true,
            mocks.slow_tail_decode,
            &first_chunk,
            false,
        ),
        (
            "completions, whole, prefix-cache routing",
            false,
            false,
            mocks.decode,
            settings,
            true,
        ),
    ];
    for (scenario, stream, first_byte, decode, settings, cache_aware) in workloads {
        if !cache_aware {
            let direct = Run {
                scenario,
                system: "direct to mock D",
                target: decode,
                pid: None,
                stream,
                first_byte,
            };
            measure(settings, direct, &mut rows).await;
        }
        for proxy in proxies {
            let mut process = proxy
                .start(&settings.run_dir, &mocks, decode, cache_aware)
                .await?;
            let target: SocketAddr = process
                .url
                .trim_start_matches("http://")
                .parse()
                .map_err(|e| format!("{e}"))?;
            let run = Run {
                scenario,
                system: &proxy.name,
                target,
                pid: process.pid(),
                stream,
                first_byte,
            };
            measure(settings, run, &mut rows).await;
            process.stop(Duration::from_secs(5)).await;
        }
    }
    Ok(rows)
}

/// TTFT of one proxy mode with simulated engines.
#[derive(Debug, Clone)]
pub struct TtftRow {
    /// `concurrent` or `sequential`.
    pub mode: String,
    /// Concurrent clients.
    pub concurrency: usize,
    /// TTFT quantiles in ms.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Requests measured.
    pub requests: usize,
}

/// Streamed requests with a 1000-token prompt through a cluster of sim engines whose prefill
/// takes 200 µs per token, with the proxy in concurrent and in sequential mode.
pub async fn ttft(
    bin_dir: &Path,
    run_dir: &Path,
    requests: usize,
    levels: &[usize],
) -> Result<Vec<TtftRow>, String> {
    // 1000 tokens: the engines' default tokenizer makes one token of each byte.
    let prompt = "ttft ".repeat(200);
    let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4, "stream": true});
    let mut rows = Vec::new();
    for mode in ["concurrent", "sequential"] {
        let mut spec =
            ClusterSpec::demo(bin_dir.to_path_buf(), run_dir.join(format!("ttft-{mode}")));
        spec.prefills = vec![PrefillShape { dp: 1, tp: 2 }];
        spec.decodes = 1;
        spec.prefill_us_per_token = 200;
        spec.decode_ms_per_token = 10;
        spec.proxy_args = vec!["--mode".to_owned(), mode.to_owned()];
        let cluster = Cluster::start(&spec).await.map_err(|e| e.to_string())?;
        let url = format!("{}/v1/completions", cluster.proxy.url);
        let http = reqwest::Client::new();
        for &concurrency in levels {
            let concurrency = concurrency.max(1);
            let mut ttfts = Vec::new();
            for _ in 0..requests.div_ceil(concurrency) {
                let round =
                    (0..concurrency).map(|_| send(&http, &url, &body, Duration::from_secs(30)));
                for answer in futures_util::future::join_all(round).await {
                    let answer = answer?;
                    if answer.status != 200 || answer.stream_error.is_some() {
                        return Err(format!(
                            "{mode}: request failed: {} {}",
                            answer.status, answer.text
                        ));
                    }
                    ttfts.push(answer.ttft.as_secs_f64() * 1e3);
                }
            }
            ttfts.sort_by(f64::total_cmp);
            let at = |q: f64| ttfts[((ttfts.len() - 1) as f64 * q).round() as usize];
            rows.push(TtftRow {
                mode: mode.to_owned(),
                concurrency,
                p50_ms: at(0.5),
                p99_ms: at(0.99),
                requests: ttfts.len(),
            });
        }
        cluster.shutdown().await;
    }
    Ok(rows)
}
