//! Two prefills that both register as dp_rank 0 (vLLM's external or hybrid DP load balancing)
//! on one real bootstrap-server with `--instance`: one registers on the main port, the other on
//! its instance's own port (all a stock vLLM prefill can name); a real pd-proxy is given the
//! second one's registry by its nested URL (`/instances/NAME`), which reaches the decode as
//! `remote_bootstrap_addr`. Both prefills keep their slot and every request is answered, through
//! each of them.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::start_binary;
use pd_examples::cluster::{free_port, Process};
use serde_json::{json, Value};

async fn get(url: &str) -> (u16, Value) {
    let answer = reqwest::get(url).await.unwrap();
    (answer.status().as_u16(), answer.json().await.unwrap())
}

/// A sim prefill that registers its one worker with `bootstrap` as engine `engine`.
async fn prefill(dir: &std::path::Path, bootstrap: &str, engine: &str) -> Process {
    let args = [
        "--role",
        "prefill",
        "--port",
        &free_port().to_string(),
        "--bootstrap",
        bootstrap,
    ];
    let args = args.into_iter().chain(["--engine-id", engine]);
    let args: Vec<String> = args.map(str::to_owned).collect();
    start_binary(dir, "sim-engine", &args, "/health").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_dp_rank_0_prefills_on_one_registry_both_serve() {
    let dir = tempfile::tempdir().unwrap();
    let (main_port, b_port) = (free_port().to_string(), free_port().to_string());
    let data = dir.path().join("data").display().to_string();
    let instance = format!("b={b_port}");
    let args = ["--host", "127.0.0.1", "--port", &main_port, "--settle", "0"];
    let args = args
        .into_iter()
        .chain(["--data-dir", &data, "--instance", &instance]);
    let args: Vec<String> = args.map(str::to_owned).collect();
    let _bootstrap = start_binary(dir.path(), "bootstrap-server", &args, "/health").await;
    let main = format!("http://127.0.0.1:{main_port}");
    let own_port = format!("http://127.0.0.1:{b_port}");
    let nested = format!("{main}/instances/b");

    let p_a = prefill(dir.path(), &main, "engine-a").await;
    let p_b = prefill(dir.path(), &own_port, "engine-b").await;
    let args = ["--role", "decode", "--port", &free_port().to_string()];
    let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
    let d = start_binary(dir.path(), "sim-engine", &args, "/health").await;

    // Each registry holds its own dp rank 0.
    let (status, a) = get(&format!("{main}/query")).await;
    assert_eq!(
        (status, &a["0"]["engine_id"]),
        (200, &json!("engine-a")),
        "{a}"
    );
    let (status, b) = get(&format!("{nested}/query")).await;
    assert_eq!(
        (status, &b["0"]["engine_id"]),
        (200, &json!("engine-b")),
        "{b}"
    );
    assert_eq!(get(&format!("{own_port}/query")).await.1, b);

    let proxy_port = free_port().to_string();
    let args = [
        "--port",
        &proxy_port,
        "--prefill",
        &p_a.url,
        &main,
        "--prefill",
        &p_b.url,
        &nested,
    ];
    let args = args.into_iter().chain(["--decode", &d.url]);
    let args: Vec<String> = args.map(str::to_owned).collect();
    let _proxy = start_binary(dir.path(), "pd-proxy", &args, "/health").await;
    let proxy = format!("http://127.0.0.1:{proxy_port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, ready) = get(&format!("{proxy}/ready")).await;
        if ready["ready_pairs"] == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the proxy never saw both prefills: {ready}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let client = reqwest::Client::new();
    let mut by_prefill = BTreeMap::<String, usize>::new();
    for i in 0..8 {
        let body = json!({"model": "sim-model", "prompt": format!("request {i}"), "max_tokens": 4});
        let answer = client
            .post(format!("{proxy}/v1/completions"))
            .header("x-pd-route", "1");
        let answer = answer
            .json(&body)
            .timeout(Duration::from_secs(20))
            .send()
            .await
            .unwrap();
        let route = answer.headers()["x-pd-route"].to_str().unwrap().to_owned();
        let status = answer.status();
        let body: Value = answer.json().await.unwrap();
        assert_eq!(status, 200, "{route}: {body}");
        assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
        let prefill = [&p_a.url, &p_b.url]
            .into_iter()
            .find(|url| route.contains(&format!("prefill={url}")))
            .unwrap_or_else(|| panic!("no known prefill in {route}"));
        *by_prefill.entry(prefill.clone()).or_default() += 1;
    }
    // A 200 from the decode means it found P's engine in the registry it was told and pulled
    // the KV (it answers 503 otherwise), so both registries served the decode.
    assert_eq!(by_prefill.len(), 2, "both prefills served: {by_prefill:?}");
}
