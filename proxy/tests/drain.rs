//! Draining: an engine marked in its bootstrap server's registry stops getting requests from
//! every proxy within a second while its requests in flight finish; a backend drained at one
//! proxy's admin route stops getting that proxy's requests; both are lifted again.

mod common;

use std::time::{Duration, Instant};

use bootstrap_server::{Server, ServerConfig};
use common::*;
use pd_protocol::vllm::RegisterWorker;
use pd_proxy::ProxyHandle;
use serde_json::{json, Value};
use worker_client::BootstrapClient;

async fn admin_backends(proxy: &ProxyHandle) -> Value {
    get_json(proxy, "/admin/backends").await
}

fn rank_draining(backends: &Value, dp_rank: u64) -> bool {
    backends["prefills"][0]["dp_ranks"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["dp_rank"] == dp_rank && r["draining"] == true)
}

async fn complete(proxy: &ProxyHandle) -> u16 {
    client()
        .post(format!("{}/v1/completions", proxy.url()))
        .json(&json!({"prompt": "hello", "max_tokens": 4}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

fn ranks_seen(prefill: &Mock) -> Vec<String> {
    prefill
        .seen()
        .iter()
        .map(|seen| seen.header("x-data-parallel-rank").unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_drain_reaches_every_proxy_and_lets_requests_in_flight_finish() {
    let dir = tempfile::tempdir().unwrap();
    let bootstrap = Server::bind(ServerConfig::local(dir.path()))
        .await
        .unwrap()
        .spawn();
    let registry = BootstrapClient::new(&bootstrap.url()).unwrap();
    for dp_rank in 0..2 {
        registry
            .register_worker(&RegisterWorker {
                engine_id: format!("engine-{dp_rank}"),
                dp_rank,
                addr: format!("tcp://127.0.0.1:{}", 42000 + dp_rank),
                ..RegisterWorker::default()
            })
            .await
            .unwrap();
    }
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    let mut proxies = Vec::new();
    for _ in 0..2 {
        // Polling every minute: only the watch can bring the mark in time.
        let config = config(vec![target(&prefill, &bootstrap.url())], vec![decode.url()]);
        let proxy = start_proxy(config).await;
        wait_ready(&proxy).await;
        proxies.push(proxy);
    }
    // Both proxies follow the watch before the mark is set.
    let watching = format!("backend=\"{}\"", prefill.url());
    for proxy in &proxies {
        eventually_async(|| async {
            sample(
                &metrics(proxy).await,
                "pd_proxy_discovery_watching",
                &watching,
            ) == 1.0
        })
        .await;
    }
    // A slow request in flight on dp rank 0 through the first proxy.
    decode.set(|b| b.delay = Duration::from_millis(1500));
    prefill.set(|b| b.delay = Duration::ZERO);
    let in_flight = {
        let url = format!("{}/v1/completions", proxies[0].url());
        tokio::spawn(async move {
            let mut statuses = Vec::new();
            // Round robin: two requests cover both dp ranks.
            let calls = (0..2).map(|_| {
                client()
                    .post(&url)
                    .json(&json!({"prompt": "slow", "max_tokens": 4}))
                    .send()
            });
            for response in futures_util::future::join_all(calls).await {
                statuses.push(response.unwrap().status().as_u16());
            }
            statuses
        })
    };
    eventually("both slow requests to reach P", || {
        prefill.seen().len() == 2
    })
    .await;

    let marked = Instant::now();
    assert_eq!(registry.drain("engine-0", true).await.unwrap(), 1);
    for proxy in &proxies {
        while !rank_draining(&admin_backends(proxy).await, 0) {
            assert!(
                marked.elapsed() < Duration::from_secs(1),
                "the mark took over a second"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let reached = marked.elapsed();
    // New requests, through either proxy, all go to dp rank 1.
    decode.set(|b| b.delay = Duration::ZERO);
    let before = prefill.seen().len();
    for proxy in &proxies {
        for _ in 0..6 {
            assert_eq!(complete(proxy).await, 200);
        }
    }
    let ranks = ranks_seen(&prefill);
    assert!(
        ranks[before..].iter().all(|r| r == "1"),
        "{ranks:?} (mark seen after {reached:?})"
    );
    // The requests in flight finished, and the drained rank shows idle.
    assert_eq!(in_flight.await.unwrap(), [200, 200]);
    let backends = admin_backends(&proxies[0]).await;
    let rank0 = &backends["prefills"][0]["dp_ranks"][0];
    assert_eq!(
        (rank0["dp_rank"].as_u64(), rank0["in_flight"].as_u64()),
        (Some(0), Some(0))
    );

    // Lifted: dp rank 0 takes requests again on both proxies.
    registry.drain("engine-0", false).await.unwrap();
    for proxy in &proxies {
        eventually_async(|| async { !rank_draining(&admin_backends(proxy).await, 0) }).await;
        let before = prefill.seen().len();
        for _ in 0..4 {
            assert_eq!(complete(proxy).await, 200);
        }
        assert!(ranks_seen(&prefill)[before..].iter().any(|r| r == "0"));
    }
}

async fn eventually_async<F, Fut>(check: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + WAIT;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn drain_call(proxy: &ProxyHandle, key: Option<&str>, body: Value) -> (u16, Value) {
    let mut request = client().post(format!("{}/admin/drain", proxy.url()));
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    let response = request.json(&body).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

#[tokio::test]
async fn a_backend_drained_at_the_admin_route_gets_no_new_requests() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |config| {
        config.admin_key = Some("ops".into());
    })
    .await;
    let target = cluster.decodes[0].url();
    let (status, body) = drain_call(&cluster.proxy, None, json!({"url": target})).await;
    assert_eq!(status, 401, "{body}");
    let (status, body) = drain_call(&cluster.proxy, Some("wrong"), json!({"url": target})).await;
    assert_eq!(status, 401, "{body}");
    let (status, body) = drain_call(
        &cluster.proxy,
        Some("ops"),
        json!({"url": "http://nowhere:1"}),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    assert!(
        body["error"]["message"].as_str().unwrap().contains("`url`"),
        "{body}"
    );
    let (status, body) = drain_call(&cluster.proxy, Some("ops"), json!({"uri": target})).await;
    assert_eq!(status, 400, "{body}");

    let (status, body) = drain_call(&cluster.proxy, Some("ops"), json!({"url": target})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (body["drained"].as_bool(), body["idle"].as_bool()),
        (Some(true), Some(true))
    );
    cluster.complete(6).await;
    assert!(cluster.decodes[0].seen().is_empty());
    assert_eq!(cluster.decodes[1].seen().len(), 6);

    let undo = json!({"url": target, "draining": false});
    assert_eq!(drain_call(&cluster.proxy, Some("ops"), undo).await.0, 200);
    cluster.complete(4).await;
    assert!(!cluster.decodes[0].seen().is_empty());
}

#[tokio::test]
async fn without_an_admin_key_the_drain_route_is_off() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    let (status, body) =
        drain_call(&cluster.proxy, None, json!({"url": cluster.decode().url()})).await;
    assert_eq!(status, 403, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--admin-key"));
    // Reading the backends' state stays open.
    let backends = admin_backends(&cluster.proxy).await;
    assert_eq!(backends["decodes"][0]["idle"], true);
}
