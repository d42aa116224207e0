//! SGLang end to end with the real binaries on 127.0.0.1: prefill ranks register over
//! `PUT /route`, the proxy's SGLang mode puts `bootstrap_host/port/room` in both bodies, decodes
//! look P up over `GET /route` and pull the room's KV; a restarted prefill is found again.
//!
//! Needs the workspace binaries in the test's target folder, which `cargo test --workspace`
//! builds.

use std::path::PathBuf;
use std::time::Duration;

use futures_util::future::join_all;
use pd_examples::cluster::{free_port, spawn, wait_for, Cluster, ClusterSpec, PrefillShape};
use pd_examples::openai_client::send;
use pd_examples::sim::Dialect;
use serde_json::{json, Value};

fn bin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf()
}

async fn stats(url: &str) -> Value {
    reqwest::get(format!("{url}/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

const TOPOLOGY: &str =
    "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sglang_cluster_serves_generate_and_openai_with_verified_kv() {
    let run_dir = tempfile::Builder::new()
        .prefix("e2e-sglang-")
        .tempdir()
        .unwrap();
    let mut spec = ClusterSpec::demo(bin_dir(), run_dir.path().to_path_buf());
    spec.dialect = Dialect::Sglang;
    spec.prefills = vec![PrefillShape { dp: 2, tp: 2 }, PrefillShape { dp: 1, tp: 2 }];
    spec.prefill_us_per_token = 100;
    spec.decode_ms_per_token = 2;
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    // SGLang's topology as the first prefill registered it: dp 2 x tp 2.
    let topology: Value = reqwest::get(format!("{}{TOPOLOGY}", cluster.bootstraps[0].url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (
            topology["dp_size"].as_u64(),
            topology["attn_tp_size"].as_u64()
        ),
        (Some(2), Some(2))
    );

    let http = reqwest::Client::new();
    let answers = join_all((0..30).map(|i| {
        let http = &http;
        let proxy = &cluster.proxy.url;
        async move {
            let prompt = format!("request number {i} asks for a streamed answer");
            let (path, body) = if i % 2 == 0 {
                ("/generate", json!({"text": prompt, "sampling_params": {"max_new_tokens": 6}, "stream": true}))
            } else {
                ("/v1/completions", json!({"model": "sim-model", "prompt": prompt, "max_tokens": 6, "stream": true}))
            };
            let answer = send(http, &format!("{proxy}{path}"), &body, Duration::from_secs(30))
                .await
                .unwrap();
            (path, answer)
        }
    }))
    .await;
    for (i, (path, answer)) in answers.iter().enumerate() {
        assert_eq!(answer.status, 200, "request {i} on {path}: {}", answer.text);
        assert!(answer.done, "request {i} on {path} ended with [DONE]");
        assert_eq!(
            answer.text.split_whitespace().count(),
            6,
            "request {i}: {:?}",
            answer.text
        );
    }
    let (mut verified, mut failed) = (0, 0);
    for decode in &cluster.decodes {
        let s = stats(&decode.url).await;
        verified += s["kv_transfers_verified"].as_u64().unwrap();
        failed += s["kv_transfers_failed"].as_u64().unwrap();
    }
    assert_eq!(
        (verified, failed),
        (30, 0),
        "every room's KV pulled and verified"
    );
    for prefill in &cluster.prefills {
        assert!(
            stats(&prefill.url).await["kv_published"].as_u64().unwrap() > 0,
            "{} computed no KV",
            prefill.name
        );
    }
    // A whole /generate answer has SGLang's shape.
    let whole: Value = http
        .post(format!("{}/generate", cluster.proxy.url))
        .json(&json!({"text": "hello there", "sampling_params": {"max_new_tokens": 3}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(whole["meta_info"]["completion_tokens"], 3, "{whole}");
    assert_eq!(
        whole["text"].as_str().unwrap().split_whitespace().count(),
        3
    );
    cluster.shutdown().await;
}

/// One request as SGLang's router sends it: the same body with one room to P and D at once.
async fn pair(prefill: &str, decode: &str, bootstrap_port: u16, room: u64) -> (u16, String) {
    let body = json!({"text": format!("room {room} prompt"), "sampling_params": {"max_new_tokens": 2},
        "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room});
    let http = reqwest::Client::new();
    let (_, d) = tokio::join!(
        http.post(format!("{prefill}/generate")).json(&body).send(),
        http.post(format!("{decode}/generate")).json(&body).send(),
    );
    let d = d.unwrap();
    (d.status().as_u16(), d.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sglang_prefill_is_pulled_from_after_at_most_one_failure() {
    let run_dir = tempfile::tempdir().unwrap();
    let dir = run_dir.path();
    let bin = bin_dir();
    let s = |v: &dyn ToString| v.to_string();
    let bootstrap_port = free_port();
    let mut bootstrap = spawn(
        dir,
        "bootstrap",
        &bin.join("bootstrap-server"),
        &[
            s(&"--host"),
            s(&"127.0.0.1"),
            s(&"--port"),
            s(&bootstrap_port),
            s(&"--data-dir"),
            dir.join("data").display().to_string(),
        ],
        format!("http://127.0.0.1:{bootstrap_port}"),
    )
    .unwrap();
    wait_for(&mut bootstrap, "/health", Duration::from_secs(10))
        .await
        .unwrap();
    let bootstrap_url = bootstrap.url.clone();
    let sim = |name: &str, role: &str| {
        let port = free_port();
        let args = [
            s(&"--dialect"),
            s(&"sglang"),
            s(&"--role"),
            s(&role),
            s(&"--port"),
            s(&port),
            s(&"--tp-size"),
            s(&2),
            s(&"--bootstrap"),
            bootstrap_url.clone(),
            s(&"--kv-wait"),
            s(&5),
        ];
        spawn(
            dir,
            name,
            &bin.join("sim-engine"),
            &args,
            format!("http://127.0.0.1:{port}"),
        )
        .unwrap()
    };
    let mut prefill = sim("prefill-a", "prefill");
    let mut decode = sim("decode", "decode");
    wait_for(&mut prefill, "/health", Duration::from_secs(10))
        .await
        .unwrap();
    wait_for(&mut decode, "/health", Duration::from_secs(10))
        .await
        .unwrap();
    wait_for(&mut bootstrap, TOPOLOGY, Duration::from_secs(10))
        .await
        .unwrap();
    let (status, text) = pair(&prefill.url, &decode.url, bootstrap_port, 7).await;
    assert_eq!(status, 200, "{text}");

    // The prefill restarts: new transfer ports, its ranks PUT again over the old rows.
    prefill.kill().await;
    let mut restarted = sim("prefill-b", "prefill");
    wait_for(&mut restarted, "/health", Duration::from_secs(10))
        .await
        .unwrap();
    let mut failures = 0;
    for room in 8..12 {
        let (status, text) = pair(&restarted.url, &decode.url, bootstrap_port, room).await;
        if status != 200 {
            failures += 1;
            assert!(text.contains("KV transfer failed"), "{text}");
        }
    }
    assert!(
        failures <= 1,
        "{failures} requests failed after the restart"
    );
    let s = stats(&decode.url).await;
    assert!(s["kv_transfers_verified"].as_u64().unwrap() >= 4, "{s}");
}
