//! Discovery's retries: a wake-up (here a registration the bootstrap server's `/watch` reports)
//! ends a retry's wait at once, no wait is longer than the backoff's cap, jitter included, and
//! a prefill that registers before its `/health` answers is asked again at the health checks'
//! recovery interval, not the backoff's. And a D that fails as vLLM's does when it cannot find
//! a prefill that re-registered under a new engine id is told the new id.

mod common;

use std::time::{Duration, Instant};

use common::registry::{real_bootstrap, register_rank};
use common::*;
use serde_json::json;

#[tokio::test]
async fn a_registration_wakes_discovery_while_it_waits_to_retry() {
    let dir = tempfile::tempdir().unwrap();
    let bootstrap = real_bootstrap(dir.path()).await;
    let url = bootstrap.url();
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    let mut config = config(vec![target(&prefill, &url)], vec![decode.url()]);
    // The binary's backoff: from 100 ms, doubling, up to 5 s.
    config.router.discovery.backoff_min = Duration::from_millis(100);
    config.router.discovery.backoff_max = Duration::from_secs(5);
    let proxy = start_proxy(config).await;
    // Nothing is registered: five attempts fail, after which the next wait is 0.8 to 1.6 s.
    let failed = format!("backend=\"{}\",outcome=\"error\"", prefill.url());
    wait_metrics(&proxy, "five failed discoveries", |m| {
        sample(m, "pd_proxy_discoveries_total", &failed) >= 5.0
    })
    .await;
    let registered = Instant::now();
    register_rank(&url, "engine-a0", 0, false).await;
    wait_ready(&proxy).await;
    assert!(
        registered.elapsed() < Duration::from_millis(600),
        "routable {:?} after the registration",
        registered.elapsed()
    );
    assert_eq!(complete_status(&proxy).await, 200);
    proxy.shutdown().await.unwrap();
    bootstrap.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_prefill_registered_before_its_health_answers_is_used_soon_after_it_does() {
    let dir = tempfile::tempdir().unwrap();
    let bootstrap = real_bootstrap(dir.path()).await;
    let url = bootstrap.url();
    register_rank(&url, "engine-a0", 0, false).await;
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    let mut config = config(vec![target(&prefill, &url)], vec![decode.url()]);
    config.router.discovery.backoff_min = Duration::from_millis(100);
    config.router.discovery.backoff_max = Duration::from_secs(5);
    let proxy = start_proxy(config).await;
    wait_for_engine(&proxy, &decode, "engine-a0").await;
    // P restarts: the new engine registers (the watch wakes discovery) before /health answers.
    // The health checks (every 60 s here) see none of it; discovery fails five times.
    prefill.set_healthy(false);
    register_rank(&url, "engine-b0", 0, true).await;
    let failed = format!("backend=\"{}\",outcome=\"error\"", prefill.url());
    wait_metrics(&proxy, "five failed discoveries", |m| {
        sample(m, "pd_proxy_discoveries_total", &failed) >= 5.0
    })
    .await;
    prefill.set_healthy(true);
    let answering = Instant::now();
    wait_for_engine(&proxy, &decode, "engine-b0").await;
    // At most the 0.5 s recovery interval, where the backoff would wait 0.8 s or more.
    assert!(
        answering.elapsed() < Duration::from_millis(750),
        "used {:?} after its /health answered",
        answering.elapsed()
    );
    proxy.shutdown().await.unwrap();
    bootstrap.shutdown().await.unwrap();
}

#[tokio::test]
async fn no_retry_waits_longer_than_the_backoff_cap() {
    let bootstrap = Bootstrap::start(json!({})).await;
    bootstrap.set(503, json!({"detail": "topology is not ready."}));
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    // Backoff from 20 ms up to 200 ms.
    let proxy = start_proxy(config(
        vec![target(&prefill, &bootstrap.url())],
        vec![decode.url()],
    ))
    .await;
    eventually("fifteen attempts", || bootstrap.queries() >= 15).await;
    let times = bootstrap.query_times();
    // From the fifth attempt on, every wait is drawn at the cap (between 100 and 200 ms); the
    // attempt itself and the timers' slack on a busy machine may add to one, but the old
    // backoff's jitter (up to twice the cap) would show in the median. backoff.rs's unit test
    // proves the cap itself.
    let mut waits: Vec<Duration> = times[4..15]
        .windows(2)
        .map(|pair| pair[1] - pair[0])
        .collect();
    waits.sort();
    assert!(
        waits[waits.len() / 2] <= Duration::from_millis(230),
        "{waits:?}"
    );
    assert!(
        waits.iter().all(|wait| *wait < Duration::from_millis(400)),
        "{waits:?}"
    );
    proxy.shutdown().await.unwrap();
}

/// P restarted under a new engine id that discovery has not learnt (no watch on this bootstrap
/// server, periodic discovery off): D fails as vLLM 0.32's does (a generic 500 whole, an SSE
/// error event streamed), the proxy finds the new id in the registry and asks the same D again
/// with it and the same transfer id, once; P is not called again.
#[tokio::test]
async fn a_decode_that_cannot_find_a_re_registered_prefill_is_told_its_new_engine_id() {
    let (prefill, decode, bootstrap, proxy) =
        proxy_with_bootstrap(topology(&[(0, "engine-old")])).await;
    for (stream, known, engine) in [
        (false, "engine-old", "engine-new"),
        (true, "engine-new", "engine-newer"),
    ] {
        wait_for_engine(&proxy, &decode, known).await;
        bootstrap.set(200, topology(&[(0, engine)]));
        decode.set(|b| b.pulls_only_from = Some(engine.to_owned()));
        let (calls_to_p, calls_to_d) = (prefill.seen().len(), decode.seen().len());
        let answer = client()
            .post(format!("{}/v1/completions", proxy.url()))
            .json(&json!({"prompt": "hi", "stream": stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
        let text = answer.text().await.unwrap();
        assert!(!text.contains("error"), "stream={stream}: {text}");
        let seen = decode.seen();
        assert_eq!(seen.len(), calls_to_d + 2, "D is asked twice");
        assert_eq!(prefill.seen().len(), calls_to_p + 1, "P is asked once");
        let params = |i: usize| seen[calls_to_d + i].body["kv_transfer_params"].clone();
        assert_eq!(params(0)["remote_engine_id"], known);
        assert_eq!(params(1)["remote_engine_id"], engine);
        assert_eq!(params(0)["transfer_id"], params(1)["transfer_id"]);
    }
    proxy.shutdown().await.unwrap();
}

/// The same failure while the registry still lists the engine D was told: not an unknown
/// engine, so no second call to that D (the only decode), and the client gets D's error.
#[tokio::test]
async fn a_decode_failure_with_the_engine_still_registered_is_not_repeated() {
    let (_prefill, decode, _bootstrap, proxy) =
        proxy_with_bootstrap(topology(&[(0, "engine-a")])).await;
    wait_for_engine(&proxy, &decode, "engine-a").await;
    decode.set(|b| b.pulls_only_from = Some("engine-elsewhere".to_owned()));
    let before = decode.seen().len();
    assert_eq!(complete_status(&proxy).await, 500);
    assert_eq!(decode.seen().len(), before + 1);
    proxy.shutdown().await.unwrap();
}
