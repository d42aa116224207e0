//! Health checks: a backend out of rotation is checked at the recovery interval, so a restarted
//! prefill is back about a second after it answers; a slow `/health` takes out only a backend
//! that answers nothing else either.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

#[tokio::test]
async fn a_restarted_prefill_is_back_within_a_second_of_answering_its_health() {
    // Checks every 60 s (the tests' configuration): only the recovery interval can be in time.
    let cluster = Cluster::start(1, &[(0, "engine-a")], |config| {
        config.prefill_timeout = Duration::from_millis(300)
    })
    .await;
    // P freezes (D waits for its KV): the request fails, P is taken out at once.
    cluster.prefill.set(|b| b.delay = Duration::from_secs(60));
    cluster.decode().set(|b| b.delay = Duration::from_secs(60));
    let (status, _, text) = cluster
        .post("/v1/completions", json!({"prompt": "hi"}))
        .await;
    assert_eq!(status, 504, "{text}");
    // P restarts: it registers its new engine before its /health answers, as vLLM does.
    cluster.prefill.set_healthy(false);
    cluster.prefill.set(|b| b.delay = Duration::ZERO);
    cluster.decode().set(|b| b.delay = Duration::ZERO);
    cluster.bootstrap.set(200, topology(&[(0, "engine-b")]));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(complete_status(&cluster.proxy).await, 503);
    cluster.prefill.set_healthy(true);
    let answering = Instant::now();
    wait_for_engine(&cluster.proxy, cluster.decode(), "engine-b").await;
    assert!(
        answering.elapsed() < Duration::from_millis(1500),
        "back {:?} after its /health answered",
        answering.elapsed()
    );
}

#[tokio::test]
async fn a_slow_health_answer_takes_out_only_a_backend_that_answers_nothing_else() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.router.health.interval = Duration::from_millis(100);
        config.router.health.timeout = Duration::from_millis(100);
        config.router.health.failure_threshold = 2;
        // Only requests tell the proxy the decode is alive.
        config.router.engine_metrics_interval = None;
    })
    .await;
    let decode = cluster.decode();
    let label = format!("backend=\"{}\",role=\"decode\"", decode.url());
    // A busy decode: its /health takes 1 s while it streams one token every 50 ms.
    decode.set_health_delay(Duration::from_secs(1));
    decode.set(|b| {
        b.chunks = (0..10)
            .map(|i| format!(r#"{{"choices":[{{"text":"t{i}"}}]}}"#))
            .collect();
        b.chunks.push("[DONE]".to_owned());
        b.chunk_gap = Duration::from_millis(50);
    });
    let busy = Instant::now();
    let mut streams = 0;
    while busy.elapsed() < Duration::from_millis(1500) {
        let response = cluster
            .stream(json!({"prompt": "hi", "stream": true}))
            .await;
        assert_eq!(response.status(), 200, "the busy decode was taken out");
        let text = response.text().await.unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        streams += 1;
    }
    assert!(streams >= 2);
    assert!(
        decode
            .state
            .health_checks
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 4
    );
    assert_eq!(
        sample(&cluster.metrics().await, "pd_proxy_backend_healthy", &label),
        1.0
    );
    // The same slow /health, and nothing else from the decode: now it is taken out.
    wait_metrics(&cluster.proxy, "the silent decode taken out", |m| {
        sample(m, "pd_proxy_backend_healthy", &label) == 0.0
    })
    .await;
}
