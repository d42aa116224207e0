//! Every engine's `GET /version` is read, and a P/D pair of different versions is named: the
//! sims play vLLM 0.32.0 (prefill) and 0.33.0 (decode) behind the real pd-proxy, which shows each
//! backend's version in `GET /admin/backends` and counts the requests placed on the mixed pair.

mod common;

use std::time::{Duration, Instant};

use common::one_pair;
use pd_examples::cluster::Cluster;
use serde_json::{json, Value};

async fn get(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pair_of_different_engine_versions_is_shown_and_counted() {
    let (mut spec, _run_dir) = one_pair("versions-");
    spec.decode_args = vec![vec!["--engine-version".into(), "0.33.0".into()]];
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let proxy = &cluster.proxy.url;

    // Each backend's version, read at its health checks.
    let started = Instant::now();
    let versions = loop {
        let backends: Value =
            serde_json::from_str(&get(&format!("{proxy}/admin/backends")).await).unwrap();
        let of = |role: &str| backends[role][0]["version"].clone();
        if !of("prefills").is_null() && !of("decodes").is_null() {
            break (of("prefills"), of("decodes"));
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{backends}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(versions, (json!("0.32.0"), json!("0.33.0")));

    for _ in 0..2 {
        let body = json!({"model": "sim-model", "prompt": "hello", "max_tokens": 2});
        let answer = reqwest::Client::new()
            .post(format!("{proxy}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
    }
    let metrics = get(&format!("{proxy}/metrics")).await;
    let mixed =
        r#"pd_proxy_mixed_version_pairs_total{decode_version="0.33.0",prefill_version="0.32.0"} 2"#;
    assert!(metrics.lines().any(|line| line == mixed), "{metrics}");
    let log = std::fs::read_to_string(&cluster.proxy.log).unwrap();
    let warned = log
        .lines()
        .filter(|l| l.contains("different engine versions"))
        .count();
    assert_eq!(warned, 1, "one warning for the pair:\n{log}");
    cluster.shutdown().await;
}
