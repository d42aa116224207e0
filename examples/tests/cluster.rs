//! End to end: the real binaries (bootstrap servers, sim engines, proxy) on 127.0.0.1.
//!
//! Needs the workspace binaries in the test's target folder, which `cargo test --workspace`
//! builds.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use pd_examples::cluster::{Cluster, ClusterSpec, PrefillShape};
use pd_examples::openai_client::send;
use serde_json::{json, Value};

fn spec(name: &str) -> (ClusterSpec, tempfile::TempDir) {
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf();
    let run_dir = tempfile::Builder::new().prefix(name).tempdir().unwrap();
    let mut spec = ClusterSpec::demo(bin_dir, run_dir.path().to_path_buf());
    spec.prefills = vec![PrefillShape { dp: 2, tp: 2 }, PrefillShape { dp: 1, tp: 2 }];
    spec.prefill_us_per_token = 100;
    spec.decode_ms_per_token = 2;
    spec.lease_ttl = Some(2);
    (spec, run_dir)
}

async fn stats(url: &str) -> Value {
    reqwest::get(format!("{url}/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn stream_body(i: usize) -> Value {
    json!({"model": "sim-model", "prompt": format!("request number {i} asks for a streamed answer"),
           "max_tokens": 8, "stream": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_streams_complete_with_verified_kv() {
    let (spec, _dir) = spec("e2e-fifty-");
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", cluster.proxy.url);
    let answers = join_all((0..50).map(|i| {
        let (http, url) = (&http, &url);
        async move {
            send(http, url, &stream_body(i), Duration::from_secs(30))
                .await
                .unwrap()
        }
    }))
    .await;
    for (i, answer) in answers.iter().enumerate() {
        assert_eq!(answer.status, 200, "request {i}: {}", answer.text);
        assert!(answer.done, "request {i} ended with [DONE]");
        assert_eq!(answer.stream_error, None, "request {i}");
        assert_eq!(
            answer.text.split_whitespace().count(),
            8,
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
        (50, 0),
        "every transfer pulled and verified"
    );
    // Both prefill engines and both decode engines took part.
    for process in cluster.prefills.iter().chain(&cluster.decodes) {
        assert!(
            stats(&process.url).await["requests"].as_u64().unwrap() > 0,
            "{} got no traffic",
            process.name
        );
    }
    // A chat request, whole, goes the same way.
    let chat = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3});
    let answer = send(
        &http,
        &format!("{}/v1/chat/completions", cluster.proxy.url),
        &chat,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(
        (answer.status, answer.text.split_whitespace().count()),
        (200, 3),
        "{}",
        answer.text
    );
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_prefill_fails_fast_while_the_others_keep_serving() {
    let (spec, _dir) = spec("e2e-kill-");
    let mut cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", cluster.proxy.url);
    // Warm up: everything works.
    for i in 0..4 {
        assert_eq!(
            send(&http, &url, &stream_body(i), Duration::from_secs(10))
                .await
                .unwrap()
                .status,
            200
        );
    }
    let workers = |bootstrap: String| async move {
        let list: Value = reqwest::get(format!("{bootstrap}/workers"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        list["workers"].as_array().unwrap().len()
    };
    let bootstrap = cluster.bootstraps[0].url.clone();
    assert_eq!(workers(bootstrap.clone()).await, 4, "dp=2 x tp=2, leased");
    assert_eq!(stats(&cluster.prefills[0].url).await["leases_alive"], 4);
    cluster.prefills[0].kill().await;
    let killed = Instant::now();

    let mut ok = 0;
    let mut failed = 0;
    for i in 0..30 {
        let started = Instant::now();
        let answer = send(&http, &url, &stream_body(100 + i), Duration::from_secs(10))
            .await
            .unwrap();
        let elapsed = started.elapsed();
        if answer.status == 200 && answer.stream_error.is_none() {
            assert_eq!(answer.text.split_whitespace().count(), 8);
            ok += 1;
        } else {
            failed += 1;
            assert!(
                elapsed < Duration::from_secs(3),
                "a failure took {elapsed:?}"
            );
            let message = answer.stream_error.unwrap_or(answer.text);
            assert!(
                message.to_lowercase().contains("prefill"),
                "unclear error: {message}"
            );
        }
    }
    // The proxy takes the dead prefill out on its first refused connection, so at most the
    // requests already routed to it fail.
    assert!(
        failed <= 2 && ok >= 28,
        "the live prefill keeps serving: {ok} ok, {failed} failed"
    );
    // Its leases lapse without keepalives: the registry forgets the dead engine by itself.
    while workers(bootstrap.clone()).await > 0 {
        assert!(
            killed.elapsed() < Duration::from_secs(6),
            "the killed prefill's workers are still registered"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.shutdown().await;
}

#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_moves_verified_kv_over_ucx() {
    let (mut spec, _dir) = spec("e2e-ucx-");
    spec.transfer = pd_transfer::Transport::Ucx;
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    // Every prefill worker registered a ucx:// transfer address.
    for bootstrap in &cluster.bootstraps {
        let topology: Value = reqwest::get(format!("{}/query", bootstrap.url))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let text = topology.to_string();
        assert!(
            text.contains("ucx://127.0.0.1:") && !text.contains("tcp://"),
            "{text}"
        );
    }
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", cluster.proxy.url);
    for i in 0..12 {
        let answer = send(&http, &url, &stream_body(i), Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(answer.status, 200, "request {i}: {}", answer.text);
        assert_eq!(answer.stream_error, None, "request {i}");
        assert_eq!(answer.text.split_whitespace().count(), 8, "request {i}");
    }
    let (mut verified, mut failed, mut bytes) = (0, 0, 0);
    for decode in &cluster.decodes {
        let s = stats(&decode.url).await;
        verified += s["kv_transfers_verified"].as_u64().unwrap();
        failed += s["kv_transfers_failed"].as_u64().unwrap();
        bytes += s["kv_bytes_pulled"].as_u64().unwrap();
    }
    assert_eq!((verified, failed), (12, 0), "every UCX pull verified");
    assert!(bytes > 0);
    for prefill in &cluster.prefills {
        assert_eq!(stats(&prefill.url).await["transfer"], "ucx");
    }
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_returns_to_its_cache_and_skips_prefill_once_the_decode_holds_it() {
    let (mut spec, _dir) = spec("e2e-cache-");
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }, PrefillShape { dp: 1, tp: 1 }];
    spec.prefill_us_per_token = 2000;
    spec.engine_args = ["--prefix-cache-blocks", "256"].map(str::to_owned).to_vec();
    spec.proxy_args = [
        "--policy",
        "cache_aware",
        "--decode-only-prefix-share",
        "0.5",
    ]
    .map(str::to_owned)
    .to_vec();
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", cluster.proxy.url);
    // 200 and 230 tokens: the engines' default tokenizer makes one token of each byte.
    let first: String = "turn one ".chars().cycle().take(200).collect();
    let second = format!(
        "{first}{}",
        "turn two ".chars().cycle().take(30).collect::<String>()
    );
    let mut routes = Vec::new();
    let mut ttfts = Vec::new();
    for prompt in [&first, &second] {
        let started = Instant::now();
        let response = http
            .post(&url)
            .header("x-pd-route", "1")
            .json(&json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        routes.push(
            response.headers()["x-pd-route"]
                .to_str()
                .unwrap()
                .to_owned(),
        );
        response.text().await.unwrap();
        ttfts.push(started.elapsed());
    }
    assert!(
        routes[0].starts_with("decision=disaggregated"),
        "{routes:?}"
    );
    assert!(
        routes[1].starts_with("decision=decode_only; reason=prefix_hit"),
        "{routes:?}"
    );
    // The decode computed only what its cache (filled by the first turn's KV) did not hold.
    let mut decode_hits = 0;
    for decode in &cluster.decodes {
        decode_hits += stats(&decode.url).await["prefix_cache_hits"]
            .as_u64()
            .unwrap();
    }
    assert_eq!(
        decode_hits, 192,
        "the first turn's 12 whole blocks of 16 tokens"
    );
    assert!(ttfts[1] < ttfts[0] / 2, "{ttfts:?}");
    // The engines report it as vLLM does.
    let metrics = reqwest::get(format!("{}/metrics", cluster.decodes[0].url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("vllm:prefix_cache_hits_total"),
        "{metrics}"
    );
    cluster.shutdown().await;
}
