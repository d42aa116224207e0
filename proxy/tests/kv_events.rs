//! `--kv-events`: pd-proxy follows an engine's KV cache events (found through its
//! `GET /kv_event_sources`) into its index, in sequence order: a gap is filled from the
//! engine's replay socket, or, without one, the engine's entries are dropped and rebuilt; a
//! restarted engine and one failing its health checks leave the index at once; a burst of
//! events does not hold up requests.

mod common;

use std::time::{Duration, Instant};

use common::kv_publisher::{removed, stored, Publisher};
use common::*;
use pd_protocol::kv_events::KvEvent;
use pd_proxy::config::KvEventsConfig;
use pd_proxy::ProxyHandle;
use serde_json::{json, Value};

const KEY: &str = "admin-key";

/// A prefill (with a bootstrap server) and a decode whose `/kv_event_sources` names
/// `publisher`, behind a proxy with `--kv-events` and an admin key.
async fn start(
    publisher: &Publisher,
    edit: impl FnOnce(&mut pd_proxy::Config),
) -> (Mock, Mock, Bootstrap, ProxyHandle) {
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    decode.set_kv_event_sources(publisher.sources());
    let bootstrap = Bootstrap::start(topology(&[(0, "engine-0")])).await;
    let mut config = config(vec![target(&prefill, &bootstrap.url())], vec![decode.url()]);
    config.admin_key = Some(KEY.to_owned());
    // The metrics the tests read are left open to scrapers (a key is set).
    config.metrics_open = true;
    config.router.kv_events = Some(KvEventsConfig {
        max_blocks: 1_000_000,
        rescan: Duration::from_millis(100),
        ..KvEventsConfig::default()
    });
    edit(&mut config);
    let proxy = start_proxy(config).await;
    (prefill, decode, bootstrap, proxy)
}

async fn report(proxy: &ProxyHandle) -> Value {
    json_of(
        client()
            .get(format!("{}/admin/kv-index", proxy.url()))
            .bearer_auth(KEY),
    )
    .await
}

/// The decode's engine in the report.
async fn engine(proxy: &ProxyHandle) -> Value {
    report(proxy).await["engines"]
        .as_array()
        .and_then(|engines| engines.iter().find(|e| e["role"] == "decode").cloned())
        .unwrap_or(Value::Null)
}

/// Waits until the decode's engine in the report satisfies `check`.
async fn wait_engine(proxy: &ProxyHandle, what: &str, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let engine = engine(proxy).await;
        if check(&engine) {
            return engine;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}: {engine}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes empty batches until the subscription sees them (a SUB socket misses what is
/// published before its subscription reaches the publisher); returns the next sequence number.
async fn synced(publisher: &mut Publisher, proxy: &ProxyHandle) -> u64 {
    wait_engine(proxy, "a subscription", |e| e["connected"] == true).await;
    for seq in 0..40 {
        publisher
            .publish(seq, vec![KvEvent::AllBlocksCleared], true)
            .await;
        let deadline = Instant::now() + Duration::from_millis(250);
        while Instant::now() < deadline {
            if engine(proxy).await["last_seq"] == seq {
                return seq + 1;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    panic!("the subscription never saw a batch");
}

#[tokio::test]
async fn a_gap_is_filled_from_the_replay_socket() {
    let mut publisher = Publisher::start(true).await;
    let (_prefill, _decode, _bootstrap, proxy) = start(&publisher, |_| {}).await;
    let seq = synced(&mut publisher, &proxy).await;
    publisher
        .publish(seq, vec![stored(100, 2, None, 0)], true)
        .await;
    wait_engine(&proxy, "two blocks", |e| e["blocks"] == 2).await;
    publisher
        .publish(seq + 1, vec![removed(&[101])], true)
        .await;
    wait_engine(&proxy, "one block", |e| e["blocks"] == 1).await;
    // seq + 2 never arrives live; seq + 3 does: the gap is fetched from the replay socket.
    publisher
        .publish(seq + 2, vec![stored(200, 1, Some(100), 4)], false)
        .await;
    publisher
        .publish(seq + 3, vec![stored(300, 1, None, 1000)], true)
        .await;
    let engine = wait_engine(&proxy, "the replayed block", |e| e["blocks"] == 3).await;
    assert_eq!(engine["gaps_replayed"], 1, "{engine}");
    assert_eq!(engine["gaps_dropped"], 0, "{engine}");
    assert_eq!(engine["last_seq"], seq + 3, "{engine}");
    // The engine restarts: its sequence starts again, its old entries leave.
    publisher
        .publish(0, vec![stored(900, 1, None, 5000)], true)
        .await;
    let engine = wait_engine(&proxy, "the restart", |e| e["last_seq"] == 0).await;
    assert_eq!(
        (engine["blocks"].clone(), engine["rebuilds"].clone()),
        (json!(1), json!(1))
    );
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_restarted_proxy_catches_up_on_the_engines_kept_history() {
    let mut publisher = Publisher::start(true).await;
    let (_prefill, _decode, _bootstrap, proxy) = start(&publisher, |_| {}).await;
    let seq = synced(&mut publisher, &proxy).await;
    for i in 0..20u64 {
        let first = 1000 * (i as i128 + 1);
        publisher
            .publish(seq + i, vec![stored(first, 4, None, 100 * i as u32)], true)
            .await;
    }
    publisher
        .publish(seq + 20, vec![removed(&[1000, 1001, 1002, 1003])], true)
        .await;
    let before = wait_engine(&proxy, "76 blocks", |e| e["blocks"] == 76).await;
    proxy.shutdown().await.unwrap();

    // A new proxy (a restart: it knows nothing) on the same engine, which publishes nothing
    // more: its index is whole again from the engine's replay socket alone.
    let restarted = Instant::now();
    let (_prefill, _decode, _bootstrap, proxy) = start(&publisher, |_| {}).await;
    let after = wait_engine(&proxy, "the history replayed", |e| e["blocks"] == 76).await;
    let took = restarted.elapsed();
    eprintln!("the restarted proxy's index was whole again {took:?} after its start");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_eq!(after["last_seq"], before["last_seq"], "{after}");
    // What arrives next follows on, and nothing replayed is taken for a restart.
    publisher
        .publish(seq + 21, vec![stored(50_000, 1, None, 9000)], true)
        .await;
    let next = wait_engine(&proxy, "the next batch", |e| e["blocks"] == 77).await;
    assert_eq!(
        (next["rebuilds"].clone(), next["gaps_dropped"].clone()),
        (json!(0), json!(0))
    );
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_gap_without_replay_drops_the_engines_entries() {
    let mut publisher = Publisher::start(false).await;
    let (_prefill, _decode, _bootstrap, proxy) = start(&publisher, |_| {}).await;
    let seq = synced(&mut publisher, &proxy).await;
    publisher
        .publish(seq, vec![stored(100, 3, None, 0)], true)
        .await;
    wait_engine(&proxy, "three blocks", |e| e["blocks"] == 3).await;
    // A removal is lost: the engine's entries cannot be trusted any more.
    publisher
        .publish(seq + 1, vec![removed(&[100, 101, 102])], false)
        .await;
    publisher
        .publish(seq + 2, vec![stored(500, 1, None, 100)], true)
        .await;
    let engine = wait_engine(&proxy, "the rebuild", |e| e["last_seq"] == seq + 2).await;
    assert_eq!(
        engine["blocks"], 1,
        "only what came after the gap: {engine}"
    );
    assert_eq!(
        (engine["gaps_dropped"].clone(), engine["rebuilds"].clone()),
        (json!(1), json!(1))
    );
    let metrics = metrics(&proxy).await;
    assert_eq!(
        sample(&metrics, "pd_proxy_kv_index_rebuilds_total", ""),
        1.0
    );
    assert_eq!(sample(&metrics, "pd_proxy_kv_index_blocks", ""), 1.0);
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_engine_failing_its_health_checks_leaves_the_index() {
    let mut publisher = Publisher::start(true).await;
    let (_prefill, decode, _bootstrap, proxy) = start(&publisher, |config| {
        config.router.health.interval = Duration::from_millis(100);
        config.router.health.recovery_interval = Duration::from_millis(100);
        config.router.health.failure_threshold = 1;
    })
    .await;
    let seq = synced(&mut publisher, &proxy).await;
    publisher
        .publish(seq, vec![stored(100, 2, None, 0)], true)
        .await;
    wait_engine(&proxy, "two blocks", |e| e["blocks"] == 2).await;
    decode.set_healthy(false);
    wait_engine(&proxy, "the entries to go", |e| e["blocks"] == 0).await;
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_burst_of_events_does_not_hold_up_requests() {
    let mut publisher = Publisher::start(true).await;
    let (_prefill, _decode, _bootstrap, proxy) = start(&publisher, |_| {}).await;
    let seq = synced(&mut publisher, &proxy).await;
    wait_ready(&proxy).await;
    // 100,000 blocks stored and removed, in batches of 1,000 events.
    let burst = async {
        for i in 0..100u64 {
            let first = i128::from(i) * 1000;
            let events = (0..500)
                .flat_map(|j| [stored(first + j, 1, None, j as u32), removed(&[first + j])])
                .collect();
            publisher.publish(seq + i, events, true).await;
        }
    };
    let requests = async {
        let mut slowest = Duration::ZERO;
        for _ in 0..20 {
            let started = Instant::now();
            assert_eq!(complete_status(&proxy).await, 200);
            slowest = slowest.max(started.elapsed());
        }
        slowest
    };
    let ((), slowest) = tokio::join!(burst, requests);
    assert!(
        slowest < Duration::from_secs(1),
        "a request took {slowest:?} during the burst"
    );
    let engine = wait_engine(&proxy, "the whole burst", |e| e["last_seq"] == seq + 99).await;
    assert_eq!(engine["blocks"], 0, "{engine}");
    assert_eq!(engine["malformed"], 0, "{engine}");
    // --kv-events alone (no policy routing on them) tokenizes no request.
    let metrics = metrics(&proxy).await;
    assert!(
        metrics.contains("outcome=\"ok\",route=\"/v1/completions\"} 20"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("pd_proxy_tokenize_seconds_count"),
        "{metrics}"
    );
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_index_needs_the_admin_key_and_kv_events() {
    let publisher = Publisher::start(false).await;
    let (_prefill, _decode, _bootstrap, proxy) = start(&publisher, |_| {}).await;
    let url = format!("{}/admin/kv-index", proxy.url());
    let anonymous = client().get(&url).send().await.unwrap();
    assert_eq!(anonymous.status(), 401);
    proxy.shutdown().await.unwrap();
    let (_prefill, _decode, _bootstrap, proxy) =
        start(&publisher, |config| config.router.kv_events = None).await;
    let off = client()
        .get(format!("{}/admin/kv-index", proxy.url()))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(off.status(), 404);
    assert!(off.text().await.unwrap().contains("--kv-events"));
    proxy.shutdown().await.unwrap();
}
