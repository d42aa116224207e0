//! What the sim-engine tests share: a real sim-engine on 127.0.0.1, JSON requests, and a
//! subscriber to its KV cache events (decoded with `pd_protocol::kv_events`).

// Each test binary that includes this module uses a part of it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pd_examples::cluster::{
    free_port, spawn_with_env, wait_for, ClusterSpec, PrefillShape, Process,
};
use pd_protocol::kv_events::{BlockStored, EventBatch, KvEvent};
use serde_json::{json, Value};
use zeromq::{Socket, SocketRecv, SubSocket};

/// Events on, every socket on a free port of `--host`, topic `kv`.
pub const EVENTS: &str = r#"{"enable_kv_cache_events": true, "publisher": "zmq",
    "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0", "topic": "kv"}"#;

/// How long a test waits for a message.
pub const WAIT: Duration = Duration::from_secs(5);

/// A decode engine serving requests alone, with `args` and the environment `env`, healthy; its
/// log is in the returned folder.
pub async fn sim_engine(args: &[&str], env: &[(&str, &str)]) -> (Process, tempfile::TempDir) {
    let dir = tempfile::Builder::new()
        .prefix("sim-test-")
        .tempdir()
        .unwrap();
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"));
    let port = free_port().to_string();
    let mut all = [
        "--role",
        "decode",
        "--port",
        &port,
        "--decode-ms-per-token",
        "1",
    ]
    .to_vec();
    all.extend_from_slice(args);
    let all: Vec<String> = all.into_iter().map(str::to_owned).collect();
    let url = format!("http://127.0.0.1:{port}");
    let mut process = spawn_with_env(dir.path(), "sim", &bin, &all, env, url).unwrap();
    wait_for(&mut process, "/health", Duration::from_secs(20))
        .await
        .unwrap();
    (process, dir)
}

/// A binary built beside sim-engine (`bootstrap-server`, `pd-proxy`, ...).
pub fn binary(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .join(name)
}

/// Starts the binary `name` with `args` (which must hold `--port PORT`) in `dir`, and waits until
/// `health` answers 200 on that port.
pub async fn start_binary(
    dir: &std::path::Path,
    name: &str,
    args: &[String],
    health: &str,
) -> Process {
    let port = args
        .iter()
        .skip_while(|a| *a != "--port")
        .nth(1)
        .expect("--port PORT")
        .clone();
    let url = format!("http://127.0.0.1:{port}");
    let mut process = pd_examples::cluster::spawn(dir, name, &binary(name), args, url).unwrap();
    wait_for(&mut process, health, Duration::from_secs(20))
        .await
        .unwrap();
    process
}

/// The spec of a small sim cluster, one prefill (dp=1, tp=1) and one decode, no KV events,
/// run in a new folder named after `prefix` (returned, to keep it for the test's life).
pub fn one_pair(prefix: &str) -> (ClusterSpec, tempfile::TempDir) {
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf();
    let run_dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    let mut spec = ClusterSpec::demo(bin_dir, run_dir.path().to_path_buf());
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
    spec.decodes = 1;
    spec.kv_events = false;
    (spec, run_dir)
}

/// A cluster of modelled sims (`--engine-model llama3-8b-h200`; KV of 4 bytes a token, so that
/// what a debug build moves and checks costs no time of its own): `prefills` prefills (dp=1,
/// tp=1) and `decodes` decodes, the proxy planning ([`planner_flags`]).
pub fn planner_cluster(
    prefix: &str,
    prefills: usize,
    decodes: usize,
) -> (ClusterSpec, tempfile::TempDir) {
    let (mut spec, run_dir) = one_pair(prefix);
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; prefills];
    spec.decodes = decodes;
    let engine = [
        "--engine-model",
        "llama3-8b-h200",
        "--kv-bytes-per-token",
        "4",
    ];
    spec.engine_args = engine.map(String::from).to_vec();
    spec.proxy_args = planner_flags();
    (spec, run_dir)
}

/// POSTs `body` as JSON: the status and the JSON answer.
pub async fn post(url: &str, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.json().await.unwrap())
}

/// Rank `rank`'s publisher config from `/kv_event_sources`.
pub async fn source(engine: &Process, rank: &str) -> Value {
    let url = format!("{}/kv_event_sources", engine.url);
    let sources: Value = reqwest::get(url).await.unwrap().json().await.unwrap();
    sources[rank].clone()
}

/// A SUB socket on rank 0's publisher, subscribed to `kv`, its subscription arrived.
pub async fn subscribe(engine: &Process) -> SubSocket {
    let endpoint = source(engine, "0").await["endpoint"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut socket = SubSocket::new();
    socket.connect(&endpoint).await.unwrap();
    socket.subscribe("kv").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    socket
}

/// A message's sequence number and batch (`frames` ends with them).
fn batch(frames: &[Bytes]) -> (i64, EventBatch) {
    let [.., seq, payload] = frames else {
        panic!("{frames:?}")
    };
    let seq = i64::from_be_bytes(seq[..].try_into().unwrap());
    (seq, EventBatch::decode(payload).unwrap())
}

/// The next message on `socket`: its sequence number and batch.
pub async fn next(socket: &mut SubSocket) -> (i64, EventBatch) {
    let message = tokio::time::timeout(WAIT, socket.recv()).await;
    let frames = message.expect("a batch in time").unwrap().into_vec();
    assert_eq!(&frames[0][..], b"kv");
    batch(&frames)
}

/// The event, which must be a `BlockStored`.
pub fn stored(event: &KvEvent) -> &BlockStored {
    match event {
        KvEvent::BlockStored(stored) => stored,
        other => panic!("not BlockStored: {other:?}"),
    }
}

/// `n` bytes of text, distinct for each `tag` (one token per byte).
pub fn text(tag: &str, n: usize) -> String {
    tag.chars().cycle().take(n).collect()
}

/// The value of `metric` on the engine's `/metrics`.
pub async fn metric(engine: &Process, metric: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", engine.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    (text.lines())
        .find(|line| line.starts_with(metric))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {metric} in:\n{text}"))
}

/// The proxy's flags: targets the modelled engines meet alone, decisions every 0.3 s over a
/// window of 3 s, metrics read every 0.2 s.
pub fn planner_flags() -> Vec<String> {
    [
        "--planner-ttft-target",
        "0.5",
        "--planner-tpot-target",
        "0.05",
        "--planner-window",
        "3",
        "--planner-interval",
        "0.3",
        "--engine-metrics-interval",
        "0.2",
    ]
    .map(String::from)
    .to_vec()
}

/// `rate` streamed completions a second of `prompt_tokens` each, asking `answer_tokens`, for
/// `seconds`; every answer must be a 200, whole, and never have its P and D on one engine (as
/// its `x-pd-route` tells).
pub async fn load(url: &str, rate: f64, seconds: f64, prompt_tokens: usize, answer_tokens: usize) {
    let client = reqwest::Client::new();
    let started = Instant::now();
    let mut sent = Vec::new();
    let mut i = 0u32;
    while started.elapsed().as_secs_f64() < seconds {
        let at = started + Duration::from_secs_f64(f64::from(i) / rate);
        tokio::time::sleep_until(at.into()).await;
        // Its own first bytes: no prompt shares a cached block with another.
        let mut prompt = format!("{i:06}-{rate}-");
        prompt.extend((prompt.len()..prompt_tokens).map(|k| char::from(b'a' + (k % 26) as u8)));
        let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": answer_tokens,
            "ignore_eos": true, "stream": true});
        let request =
            (client.post(format!("{url}/v1/completions")).json(&body)).header("x-pd-route", "1");
        sent.push(tokio::spawn(async move {
            let response = request.send().await.unwrap();
            let status = response.status();
            let route = response.headers().get("x-pd-route").cloned();
            let route = route
                .map(|r| r.to_str().unwrap().to_owned())
                .unwrap_or_default();
            let field = |name: &str| {
                (route.split("; "))
                    .find_map(|f| f.strip_prefix(name))
                    .map(str::to_owned)
            };
            if let (Some(prefill), Some(decode)) = (field("prefill="), field("decode=")) {
                assert_ne!(prefill, decode, "one engine as P and D: {route}");
            }
            let text = response.text().await.unwrap();
            assert_eq!(status, 200, "{text}");
            assert!(text.contains("[DONE]"), "{text}");
        }));
        i += 1;
    }
    for request in sent {
        request.await.unwrap();
    }
}
