//! Discovery: non-contiguous dp ranks, an empty or unreachable bootstrap server at first, engine
//! ids that change (found on D's report or periodically), and the real bootstrap server.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::registry::{real_bootstrap, register_rank};
use common::*;
use pd_protocol::vllm::RegisterWorker;
use pd_proxy::config::parse_prefill;
use serde_json::json;
use worker_client::BootstrapClient;

#[tokio::test]
async fn non_contiguous_dp_ranks_are_all_used_with_their_engine_ids() {
    let cluster = Cluster::start(1, &[(0, "e0"), (3, "e3"), (7, "e7")], |_| {}).await;
    for _ in 0..6 {
        let (status, _, _) = cluster
            .post("/v1/completions", json!({"prompt": "hi"}))
            .await;
        assert_eq!(status, 200);
    }
    let prefills = cluster.prefill.seen();
    let decodes = cluster.decode().seen();
    let mut per_rank: BTreeMap<String, usize> = BTreeMap::new();
    for p in &prefills {
        let rank = p.header("x-data-parallel-rank").unwrap();
        let id = &p.body["kv_transfer_params"]["transfer_id"];
        let d = decodes
            .iter()
            .find(|d| &d.body["kv_transfer_params"]["transfer_id"] == id)
            .expect("D got the same transfer id");
        assert_eq!(
            d.body["kv_transfer_params"]["remote_engine_id"],
            format!("e{rank}"),
            "D must pull from the engine of the dp rank P computed on"
        );
        assert_eq!(
            d.body["kv_transfer_params"]["remote_bootstrap_addr"],
            cluster.bootstrap.url()
        );
        *per_rank.entry(rank).or_default() += 1;
    }
    assert_eq!(
        per_rank,
        BTreeMap::from([("0".into(), 2), ("3".into(), 2), ("7".into(), 2)])
    );
}

#[tokio::test]
async fn empty_query_answers_503_until_a_rank_registers() {
    let (_prefill, decode, bootstrap, proxy) = proxy_with_bootstrap(json!({})).await;
    eventually("a few discovery attempts", || bootstrap.queries() >= 2).await;
    assert_eq!(complete_status(&proxy).await, 503);
    assert_eq!(ready_status(&proxy).await, 503);
    // A bootstrap server that says "not ready yet" is retried the same way.
    bootstrap.set(503, json!({"detail": "topology is not ready."}));
    let queries = bootstrap.queries();
    eventually("another attempt", || bootstrap.queries() > queries).await;
    assert_eq!(complete_status(&proxy).await, 503);
    bootstrap.set(200, topology(&[(0, "late-engine")]));
    let registered = Instant::now();
    wait_ready(&proxy).await;
    assert!(registered.elapsed() < Duration::from_secs(2));
    assert_eq!(complete_status(&proxy).await, 200);
    assert_eq!(
        decode.seen()[0].body["kv_transfer_params"]["remote_engine_id"],
        "late-engine"
    );
}

#[tokio::test]
async fn bootstrap_down_at_first_is_retried_until_it_answers() {
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    let bootstrap = Bootstrap::start(topology(&[(0, "e0")])).await;
    bootstrap.served.set_down(true);
    // Also through the real flag parser: `--prefill URL BOOTSTRAP_PORT`.
    let target = parse_prefill(
        &prefill.url(),
        Some(&bootstrap.served.addr.port().to_string()),
        None,
    )
    .unwrap();
    assert_eq!(target.bootstrap_addr, Some(bootstrap.url()));
    let proxy = start_proxy(config(vec![target], vec![decode.url()])).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ready_status(&proxy).await, 503);
    assert_eq!(complete_status(&proxy).await, 503);
    bootstrap.served.set_down(false);
    let up = Instant::now();
    wait_ready(&proxy).await;
    assert!(up.elapsed() < Duration::from_secs(2), "{:?}", up.elapsed());
    assert_eq!(complete_status(&proxy).await, 200);
}

#[tokio::test]
async fn prefill_not_healthy_at_first_delays_discovery() {
    let prefill = Mock::prefill().await;
    prefill.set_healthy(false);
    let decode = Mock::decode().await;
    let bootstrap = Bootstrap::start(topology(&[(0, "e0")])).await;
    let proxy = start_proxy(config(
        vec![target(&prefill, &bootstrap.url())],
        vec![decode.url()],
    ))
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(bootstrap.queries(), 0, "/query before P was healthy");
    assert_eq!(ready_status(&proxy).await, 503);
    prefill.set_healthy(true);
    wait_ready(&proxy).await;
    assert_eq!(complete_status(&proxy).await, 200);
}

#[tokio::test]
async fn changed_engine_id_is_rediscovered_when_decode_reports_it() {
    let cluster = Cluster::start(1, &[(0, "engine-old")], |_| {}).await;
    assert_eq!(complete_status(&cluster.proxy).await, 200);
    let discovered = format!("backend=\"{}\",outcome=\"ok\"", cluster.prefill.url());
    let before = sample(
        &metrics(&cluster.proxy).await,
        "pd_proxy_discoveries_total",
        &discovered,
    );
    // P restarted under a new engine id; D cannot find the old one.
    cluster.bootstrap.set(200, topology(&[(0, "engine-new")]));
    cluster.decode().set(|b| {
        *b = Behavior::failing(
            500,
            json!({"error": {"message": format!(
                "remote engine_id engine-old not found from bootstrap server {}",
                cluster.bootstrap.url())}}),
        )
    });
    assert_eq!(complete_status(&cluster.proxy).await, 500);
    // (D fails whatever it is told, so the request fails even once D was told the new id.)
    wait_metrics(&cluster.proxy, "a rediscovery", |m| {
        sample(m, "pd_proxy_discoveries_total", &discovered) > before
    })
    .await;
    cluster.decode().set(|b| *b = Behavior::ok(decode_answer()));
    wait_for_engine(&cluster.proxy, cluster.decode(), "engine-new").await;
}

#[tokio::test]
async fn periodic_rediscovery_picks_up_a_new_engine_id_and_survives_outages() {
    let cluster = Cluster::start(1, &[(0, "engine-old")], |config| {
        config.router.discovery.interval = Duration::from_millis(100)
    })
    .await;
    cluster.bootstrap.set(200, topology(&[(0, "engine-new")]));
    wait_for_engine(&cluster.proxy, cluster.decode(), "engine-new").await;
    // The bootstrap server going away keeps the last known ranks usable.
    cluster.bootstrap.served.set_down(true);
    let queries = cluster.bootstrap.queries();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(cluster.bootstrap.queries(), queries);
    for _ in 0..3 {
        assert_eq!(complete_status(&cluster.proxy).await, 200);
    }
    let metrics = cluster.metrics().await;
    assert!(sample(&metrics, "pd_proxy_discoveries_total", "outcome=\"error\"") >= 1.0);
}

#[tokio::test]
async fn the_real_bootstrap_server_is_understood() {
    let dir = tempfile::tempdir().unwrap();
    let bootstrap = real_bootstrap(dir.path()).await;
    let register = |engine: &'static str, dp_rank: u32, replace: bool| {
        let url = bootstrap.url();
        async move { register_rank(&url, engine, dp_rank, replace).await }
    };
    register("engine-a0", 0, false).await;
    register("engine-a2", 2, false).await;
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    let mut config = config(vec![target(&prefill, &bootstrap.url())], vec![decode.url()]);
    config.router.discovery.interval = Duration::from_millis(100);
    let proxy = start_proxy(config).await;
    wait_ready(&proxy).await;
    for _ in 0..4 {
        assert_eq!(complete_status(&proxy).await, 200);
    }
    let engines: Vec<(String, String)> = prefill
        .seen()
        .iter()
        .map(|p| {
            let id = &p.body["kv_transfer_params"]["transfer_id"];
            let d = decode
                .seen()
                .into_iter()
                .find(|d| &d.body["kv_transfer_params"]["transfer_id"] == id)
                .unwrap();
            (
                p.header("x-data-parallel-rank").unwrap(),
                d.body["kv_transfer_params"]["remote_engine_id"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            )
        })
        .collect();
    for (rank, engine) in &engines {
        assert_eq!(engine, &format!("engine-a{rank}"));
    }
    // dp rank 0 restarts under a new engine id and takes its slot over.
    register("engine-b0", 0, true).await;
    wait_for_engine(&proxy, &decode, "engine-b0").await;
    proxy.shutdown().await.unwrap();
    bootstrap.shutdown().await.unwrap();
}

#[tokio::test]
async fn new_and_restarted_prefills_are_routable_at_once_through_the_watch() {
    let dir = tempfile::tempdir().unwrap();
    let bootstrap = real_bootstrap(dir.path()).await;
    let url = bootstrap.url();
    register_rank(&url, "engine-a0", 0, false).await;
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    // Polling every 60 s: only the watch can make the changes below visible in time.
    let proxy = start_proxy(config(vec![target(&prefill, &url)], vec![decode.url()])).await;
    wait_ready(&proxy).await;
    let backend = format!("backend=\"{}\"", prefill.url());
    wait_metrics(&proxy, "the watch to start", |m| {
        sample(m, "pd_proxy_discovery_watching", &backend) == 1.0
    })
    .await;

    // A new dp rank registers.
    let registered = Instant::now();
    register_rank(&url, "engine-a1", 1, false).await;
    wait_metrics(&proxy, "dp rank 1", |m| {
        sample(m, "pd_proxy_prefill_dp_ranks", &backend) == 2.0
    })
    .await;
    assert!(
        registered.elapsed() < Duration::from_secs(1),
        "{:?}",
        registered.elapsed()
    );
    wait_for_engine(&proxy, &decode, "engine-a1").await;

    // dp rank 0 restarts under a new engine id.
    let restarted = Instant::now();
    register_rank(&url, "engine-b0", 0, true).await;
    wait_for_engine(&proxy, &decode, "engine-b0").await;
    assert!(
        restarted.elapsed() < Duration::from_secs(1),
        "{:?}",
        restarted.elapsed()
    );

    let text = metrics(&proxy).await;
    assert!(sample(&text, "pd_proxy_discovery_watch_refreshes_total", &backend) >= 2.0);
    proxy.shutdown().await.unwrap();
    bootstrap.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_bootstrap_server_without_watch_is_polled_quietly() {
    let cluster = Cluster::start(1, &[(0, "engine-old")], |config| {
        config.router.discovery.interval = Duration::from_millis(200)
    })
    .await;
    // One GET /workers answered 404, and the watch is given up for good.
    eventually("the watch attempt", || cluster.bootstrap.misses() >= 1).await;
    cluster.bootstrap.set(200, topology(&[(0, "engine-new")]));
    wait_for_engine(&cluster.proxy, cluster.decode(), "engine-new").await;
    assert_eq!(cluster.bootstrap.misses(), 1, "no /watch retries");
    let text = cluster.metrics().await;
    assert_eq!(
        sample(&text, "pd_proxy_discovery_watching", "backend="),
        0.0
    );
    assert_eq!(
        sample(
            &text,
            "pd_proxy_discovery_watch_refreshes_total",
            "backend="
        ),
        0.0
    );
}

/// Registers `engine` on dp rank 0 of the bootstrap server at `url`, serving `model`.
async fn register_model(url: &str, engine: &str, model: &str) {
    BootstrapClient::new(url)
        .unwrap()
        .register_worker(&RegisterWorker {
            engine_id: engine.into(),
            addr: "tcp://127.0.0.1:42000".into(),
            meta: pd_protocol::native::EngineMeta {
                model: Some(model.into()),
                ..Default::default()
            },
            ..RegisterWorker::default()
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn a_prefill_and_a_decode_of_different_models_are_never_paired() {
    let dir = tempfile::tempdir().unwrap();
    let bootstrap = real_bootstrap(dir.path()).await;
    let url = bootstrap.url();
    // The mock decode's /v1/models lists "mock-model".
    register_model(&url, "engine-x", "other-model").await;
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    let mut config = config(vec![target(&prefill, &url)], vec![decode.url()]);
    config.router.health.interval = Duration::from_millis(100);
    let proxy = start_proxy(config).await;
    let deadline = Instant::now() + WAIT;
    let readiness = loop {
        let answer = get_json(&proxy, "/ready").await;
        if answer["prefills"][0]["models"] == json!(["other-model"])
            && answer["decodes"][0]["models"] == json!(["mock-model"])
        {
            break answer;
        }
        assert!(Instant::now() < deadline, "models never learnt: {answer}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(readiness["status"], "not_ready");
    assert!(
        readiness["detail"].as_str().unwrap().contains("model"),
        "{readiness}"
    );
    let answer = client()
        .post(format!("{}/v1/completions", proxy.url()))
        .json(&json!({"model": "other-model", "prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 503);
    let body: serde_json::Value = answer.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("other-model"),
        "{body}"
    );
    assert!(decode.seen().is_empty(), "D never got the request");
    let text = metrics(&proxy).await;
    assert!(
        text.contains(r#"outcome="model_mismatch",route="/v1/completions"} 1"#),
        "{text}"
    );

    // The prefill restarts serving the decode's model: it is paired again.
    register_model(&url, "engine-y", "mock-model").await;
    wait_for_engine(&proxy, &decode, "engine-y").await;
    proxy.shutdown().await.unwrap();
    bootstrap.shutdown().await.unwrap();
}
