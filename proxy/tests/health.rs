//! Health checks: a backend out of rotation is checked at the recovery interval, so a restarted
//! prefill is back about a second after it answers.

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
