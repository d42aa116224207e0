//! Real vLLM engines behind bootstrap-server and pd-proxy: vLLM's CPU build (the pinned
//! environment of `examples/vllm/cpu/venv.sh`, which `.ci/run` makes) serving the tiny
//! random-weight model, made once per run of this file.
//!
//! Greedy decoding of fixed weights is deterministic, so every answer through the proxy must
//! equal, token for token, the answer of one engine alone (the prefill engine called directly,
//! with a `cache_salt` of its own so that nothing it cached is reused).
//!
//! Every process of an engine dies with it, also when only its API server is killed.
//!
//! Each test starts its own engines (20 to 120 s each on two cores); the clusters run one at a
//! time (the adapter check, named to sort first, runs beside the first). A failure names the
//! engine and shows the tail of its log.

mod dual;
mod first_token;
mod gateway;
mod instances;
mod migration;
mod mooncake;
mod nixl;
mod overload;
mod precise_prefix;
mod registration;
mod tls;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use pd_examples::cluster::{free_port, Cluster, ClusterSpec, PrefillShape, Process};
use pd_examples::openai_client::send;
use pd_examples::vllm::{self, wait_ready, Connector, EngineRole, VllmEngines};
use pd_service::otlp_receiver::{OtlpReceiver, ReceivedSpan};
use serde_json::{json, Value};
use tokio::sync::{Mutex, OnceCell};

/// One real cluster at a time: two cores hold two engines starting, not four.
static ONE_CLUSTER: Mutex<()> = Mutex::const_new(());

/// The environment's Python and the tiny model, made once for the whole file.
static SETUP: OnceCell<(PathBuf, String, tempfile::TempDir)> = OnceCell::const_new();

const SHORT_PROMPT: &str = "The quick brown fox jumps over the lazy dog.";
/// About 80 tokens of the tiny model's tokenizer: three KV blocks of 32.
const LONG_PROMPT: &str = "Prefill computes the key and value cache of the whole prompt in one \
    pass; decode then produces one token at a time from that cache. Disaggregated serving runs \
    the two phases on separate engines, and moves the cache from the prefill engine to the \
    decode engine over a transfer engine. Explain why the sky is blue, in one sentence.";

async fn engines(connector: Connector) -> VllmEngines {
    let (python, model, _) = SETUP
        .get_or_try_init(|| async {
            let python = vllm::cpu_python().await?;
            let dir = tempfile::Builder::new()
                .prefix("tiny-model-")
                .tempdir()
                .unwrap();
            let model = vllm::tiny_model(&python, dir.path()).await?;
            Ok::<_, pd_examples::cluster::ClusterError>((python, model, dir))
        })
        .await
        .unwrap_or_else(|err| panic!("the vLLM environment and the tiny model: {err}"));
    VllmEngines::new(
        python.clone(),
        model.clone(),
        vllm::TINY_MODEL_NAME.into(),
        connector,
    )
}

fn spec(name: &str, vllm: VllmEngines) -> (ClusterSpec, tempfile::TempDir) {
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf();
    let run_dir = tempfile::Builder::new().prefix(name).tempdir().unwrap();
    let mut spec = ClusterSpec::demo(bin_dir, run_dir.path().to_path_buf());
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
    spec.decodes = 1;
    spec.vllm = Some(vllm);
    (spec, run_dir)
}

async fn start(spec: &ClusterSpec) -> Cluster {
    match Cluster::start(spec).await {
        Ok(cluster) => cluster,
        Err(err) => panic!("the real-engine cluster did not start: {err}"),
    }
}

/// A greedy request of `max_tokens` exact tokens, asking for the token ids.
fn greedy(path: &str, prompt: &str, stream: bool) -> Value {
    let mut body = json!({
        "model": vllm::TINY_MODEL_NAME, "max_tokens": 12, "temperature": 0, "ignore_eos": true,
        "stream": stream, "return_token_ids": true,
    });
    if path.contains("chat") {
        body["messages"] = json!([{"role": "user", "content": prompt}]);
    } else {
        body["prompt"] = json!(prompt);
    }
    body
}

/// POSTs `body` to `base` + `path` and returns the generated text, failing the test on any
/// error (naming `who`).
async fn text(http: &reqwest::Client, base: &str, path: &str, body: &Value, who: &str) -> String {
    let answer = send(
        http,
        &format!("{base}{path}"),
        body,
        Duration::from_secs(120),
    )
    .await
    .unwrap_or_else(|err| panic!("{who}: {err}"));
    assert_eq!(answer.status, 200, "{who}: {}", answer.text);
    assert_eq!(answer.stream_error, None, "{who}");
    answer.text
}

/// A completion through the proxy.
async fn through_proxy(cluster: &Cluster, body: &Value) -> pd_examples::openai_client::Answer {
    let url = format!("{}/v1/completions", cluster.proxy.url);
    send(&reqwest::Client::new(), &url, body, Duration::from_secs(60))
        .await
        .unwrap()
}

/// One engine's own answer: the prefill engine called directly, its prefix cache not shared.
async fn reference(http: &reqwest::Client, engine: &Process, path: &str, body: &Value) -> String {
    let mut alone = body.clone();
    alone["cache_salt"] = json!(uuid::Uuid::new_v4().to_string());
    alone["stream"] = json!(false);
    text(http, &engine.url, path, &alone, "the engine alone").await
}

/// Every P/D answer through the proxy (completions and chat, whole and streamed, a short
/// prompt and one of several KV blocks, and four at once) equals the engine's own.
async fn assert_pd_equals_one_engine(cluster: &Cluster) {
    // What the cluster's callers trust and present (nothing unless it runs TLS).
    let http = (cluster.proxy.client_tls.apply(reqwest::Client::builder()))
        .build()
        .unwrap();
    let engine = &cluster.prefills[0];
    let mut cases = Vec::new();
    for path in ["/v1/completions", "/v1/chat/completions"] {
        for prompt in [SHORT_PROMPT, LONG_PROMPT] {
            for stream in [false, true] {
                cases.push((path, greedy(path, prompt, stream)));
            }
        }
    }
    for (path, body) in &cases {
        let expected = reference(&http, engine, path, body).await;
        let through = text(&http, &cluster.proxy.url, path, body, "the proxy").await;
        assert_eq!(through, expected, "{path} {body}");
    }
    let at_once = join_all((0..4).map(|i| {
        let (http, proxy) = (&http, &cluster.proxy.url);
        let body = greedy(
            "/v1/completions",
            &format!("{LONG_PROMPT} Request {i}."),
            i % 2 == 1,
        );
        async move {
            let through = text(http, proxy, "/v1/completions", &body, "the proxy").await;
            (body, through)
        }
    }))
    .await;
    for (body, through) in at_once {
        let expected = reference(&http, engine, "/v1/completions", &body).await;
        assert_eq!(through, expected, "{body}");
    }
}

/// One counter of an engine's `/metrics` (summed over its label sets matching `labels`).
async fn counter(engine: &Process, name: &str, labels: &str) -> f64 {
    let metrics = reqwest::get(format!("{}/metrics", engine.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    metrics
        .lines()
        .filter(|line| line.starts_with(name) && line.contains(labels))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn prompt_tokens_by_source(decode: &Process) -> (f64, f64) {
    let name = "vllm:prompt_tokens_by_source_total";
    (
        counter(decode, name, "source=\"external_kv_transfer\"").await,
        counter(decode, name, "source=\"local_compute\"").await,
    )
}

/// The JSON answer of `request`.
async fn json_of(request: reqwest::RequestBuilder) -> Value {
    request.send().await.unwrap().json().await.unwrap()
}

/// How many tokens the engine makes of the prompt of `body` (its own `POST /tokenize`).
async fn token_count(engine: &Process, body: &Value) -> f64 {
    let prompt = json!({"model": body["model"], "prompt": body["prompt"]});
    let request = reqwest::Client::new().post(format!("{}/tokenize", engine.url));
    let tokens = json_of(request.json(&prompt)).await;
    tokens["count"]
        .as_f64()
        .unwrap_or_else(|| panic!("/tokenize: {tokens}"))
}

/// Waits (30 s at most) until the engines of the proxy's `GET /admin/kv-index` satisfy `check`.
async fn wait_kv_index(cluster: &Cluster, check: impl Fn(&[Value]) -> bool) -> Value {
    let started = Instant::now();
    loop {
        let url = format!("{}/admin/kv-index", cluster.proxy.url);
        let report = json_of(reqwest::Client::new().get(url).bearer_auth("admin")).await;
        if report["engines"].as_array().is_some_and(|e| check(e)) {
            return report;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "{report}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The processes of process group `group` (field 5 of `/proc/PID/stat`).
fn group_members(group: i32) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // After the command, which may hold spaces and parentheses: state ppid pgrp ...
            let fields = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
            fields.split_whitespace().nth(2) == Some(&group.to_string())
        })
        .collect()
}

/// The engine id of dp rank 0 that the bootstrap server's `/query` lists.
async fn registered_engine(bootstrap: &Process) -> String {
    let url = format!("{}/query", bootstrap.url);
    let topology = json_of(reqwest::Client::new().get(url)).await;
    let engine = &topology["0"];
    assert!(
        engine["worker_addr"]["0"]["0"]
            .as_str()
            .is_some_and(|addr| addr.starts_with("tcp://127.0.0.1:")),
        "/query lists P's worker: {topology}"
    );
    engine["engine_id"].as_str().unwrap().to_owned()
}

/// The bootstrap-server binary beside the other binaries, with `flags`.
fn bootstrap_server(dir: &Path, flags: &[&str]) -> (Process, String) {
    let program = workspace_binary("bootstrap-server");
    let port = free_port().to_string();
    let data = dir.join(format!("data-{port}")).display().to_string();
    let mut args = ["--host", "127.0.0.1", "--port", &port, "--data-dir", &data].to_vec();
    args.extend_from_slice(flags);
    let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
    let url = format!("http://127.0.0.1:{port}");
    let process =
        pd_examples::cluster::spawn(dir, "bootstrap-server", &program, &args, url.clone()).unwrap();
    (process, url)
}

/// The workspace's binary `name`, beside the binaries this test was built with.
fn workspace_binary(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .join(name)
}
