//! Failures: P failing in every way cancels D quickly, D is retried once, clients going away
//! cancel both calls, unhealthy backends are skipped, and every outcome is counted.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

/// D hangs (as a real D does while it waits for KV that never comes).
fn hang(mock: &Mock) {
    mock.set(|b| b.delay = Duration::from_secs(20));
}

async fn assert_cancelled(seen: &Seen, within: Duration) {
    match seen.wait_end().await {
        End::Cancelled(at) => assert!(
            at.duration_since(seen.at) < within,
            "cancelled only after {:?}",
            at.duration_since(seen.at)
        ),
        End::Finished(_) => panic!("the call to {} was not cancelled", seen.path),
    }
}

fn message(text: &str) -> String {
    let error: Value = serde_json::from_str(text).unwrap();
    error["error"]["message"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn prefill_error_status_cancels_decode_at_once() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    cluster.prefill.set(|b| {
        *b = Behavior::failing(500, json!({"detail": "CUDA out of memory"}));
        // After D's call is in: a P failing before it was written would leave nothing to
        // cancel (and the check below nothing to see), as on a loaded machine once.
        b.delay = Duration::from_millis(150);
    });
    hang(cluster.decode());
    let (status, headers, text) = cluster
        .post_within(
            "/v1/completions",
            json!({"prompt": "hi"}),
            Duration::from_secs(1),
        )
        .await;
    // The engine's own status and message; which engine, in the operators' header only.
    assert_eq!(status, 500);
    assert_eq!(headers["content-type"], "application/json");
    let message = message(&text);
    assert!(message.contains("CUDA out of memory"), "{message}");
    assert!(!text.contains(&cluster.prefill.url()), "{text}");
    let upstream = headers["x-pd-upstream"].to_str().unwrap();
    assert!(
        upstream.starts_with(&format!("prefill {}", cluster.prefill.url())),
        "{upstream}"
    );
    let d = cluster.decode().wait_seen(1).await.remove(0);
    assert_cancelled(&d, Duration::from_secs(1)).await;
    let metrics = cluster.metrics().await;
    assert_eq!(completions_with_outcome(&metrics, "prefill_error"), 1.0);
}

#[tokio::test]
async fn prefill_client_error_keeps_its_status() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    cluster.prefill.set(|b| {
        *b = Behavior::failing(
            400,
            json!({"error": {"message": "prompt is too long", "type": "BadRequestError"}}),
        )
    });
    hang(cluster.decode());
    let (status, _, text) = cluster
        .post("/v1/completions", json!({"prompt": "hi"}))
        .await;
    assert_eq!(status, 400);
    assert!(message(&text).contains("prompt is too long"), "{text}");
}

#[tokio::test]
async fn unreachable_prefill_cancels_decode_at_once() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    cluster.prefill.served.stop();
    hang(cluster.decode());
    let (status, _, text) = cluster
        .post_within(
            "/v1/completions",
            json!({"prompt": "hi"}),
            Duration::from_secs(1),
        )
        .await;
    assert_eq!(status, 502);
    assert!(message(&text).contains("could not be reached"), "{text}");
    // The refused connection is usually noticed before D's call even arrives; if it arrived,
    // it was cancelled.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for d in cluster.decode().seen() {
        assert_cancelled(&d, Duration::from_secs(1)).await;
    }
    let metrics = cluster.metrics().await;
    let prefill = format!(
        "backend=\"{}\",outcome=\"connect_error\",role=\"prefill\"",
        cluster.prefill.url()
    );
    assert_eq!(
        sample(&metrics, "pd_proxy_backend_requests_total", &prefill),
        1.0
    );
    // The refused connection took the prefill out at once: no more traffic is sent to it.
    let healthy = format!("backend=\"{}\",role=\"prefill\"", cluster.prefill.url());
    assert_eq!(sample(&metrics, "pd_proxy_backend_healthy", &healthy), 0.0);
    let (status, _, text) = cluster
        .post("/v1/completions", json!({"prompt": "hi"}))
        .await;
    assert_eq!(status, 503, "{text}");
    let metrics = cluster.metrics().await;
    assert_eq!(
        sample(&metrics, "pd_proxy_backend_requests_total", &prefill),
        1.0,
        "no second attempt on the dead prefill"
    );
}

#[tokio::test]
async fn prefill_timeout_cancels_both() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.prefill_timeout = Duration::from_millis(300)
    })
    .await;
    cluster.prefill.set(|b| b.delay = Duration::from_secs(20));
    hang(cluster.decode());
    let started = Instant::now();
    let (status, _, text) = cluster
        .post("/v1/completions", json!({"prompt": "hi"}))
        .await;
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(300) && elapsed < Duration::from_millis(1300),
        "{elapsed:?}"
    );
    assert_eq!(status, 504);
    assert!(message(&text).contains("did not answer within"), "{text}");
    let p = cluster.prefill.wait_seen(1).await.remove(0);
    let d = cluster.decode().wait_seen(1).await.remove(0);
    assert_cancelled(&p, Duration::from_secs(2)).await;
    assert_cancelled(&d, Duration::from_secs(2)).await;
    let metrics = cluster.metrics().await;
    assert_eq!(completions_with_outcome(&metrics, "prefill_timeout"), 1.0);
}

#[tokio::test]
async fn prefill_failure_after_streaming_began_ends_the_stream_with_an_error_event() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    cluster.prefill.set(|b| {
        *b = Behavior::failing(503, json!({"detail": "prefill engine died"}));
        b.delay = Duration::from_millis(400);
    });
    cluster.decode().set(|b| {
        b.chunks = vec![r#"{"choices":[{"index":0,"text":""}]}"#.to_owned(); 20];
        b.chunk_gap = Duration::from_millis(300);
    });
    let started = Instant::now();
    let response = cluster
        .stream(json!({"prompt": "hi", "stream": true}))
        .await;
    assert_eq!(response.status(), 200);
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        body.extend_from_slice(&chunk.unwrap());
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_millis(1400),
        "stream ended after {elapsed:?}"
    );
    let text = String::from_utf8(body).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert!(events.len() >= 2, "{text}");
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let error: Value =
        serde_json::from_str(events[events.len() - 2].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(error["error"]["type"], "upstream_error");
    assert!(error["error"]["code"].is_null(), "{error}");
    assert!(error["error"]["message"]
        .as_str()
        .unwrap()
        .contains("prefill engine died"));
    let d = cluster.decode().wait_seen(1).await.remove(0);
    assert_cancelled(&d, Duration::from_secs(1)).await;
}

#[tokio::test]
async fn decode_failing_before_its_first_byte_is_retried_on_another_decode() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |_| {}).await;
    // Round robin starts with the first decode.
    cluster.decodes[0].set(|b| *b = Behavior::failing(503, json!({"detail": "overloaded"})));
    let (status, _, text) = cluster
        .post("/v1/completions", json!({"prompt": "hi"}))
        .await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap(),
        decode_answer()
    );
    let first = cluster.decodes[0].wait_seen(1).await.remove(0);
    let second = cluster.decodes[1].wait_seen(1).await.remove(0);
    assert_eq!(first.body, second.body, "the retry sends the same body");
    assert_eq!(cluster.prefill.seen().len(), 1, "P is not asked twice");
    let metrics = cluster.metrics().await;
    assert_eq!(
        sample(
            &metrics,
            "pd_proxy_decode_retries_total",
            "route=\"/v1/completions\""
        ),
        1.0
    );
}

#[tokio::test]
async fn unreachable_decode_is_retried_on_another_decode() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |_| {}).await;
    cluster.decodes[0].served.stop();
    let (status, _, _) = cluster
        .post("/v1/completions", json!({"prompt": "hi"}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(cluster.decodes[1].seen().len(), 1);
    // The dead decode was taken out: later requests go straight to the live one.
    for _ in 0..4 {
        let (status, _, _) = cluster
            .post("/v1/completions", json!({"prompt": "hi"}))
            .await;
        assert_eq!(status, 200);
    }
    assert_eq!(cluster.decodes[1].seen().len(), 5);
    let metrics = cluster.metrics().await;
    let dead = format!(
        "backend=\"{}\",outcome=\"connect_error\",role=\"decode\"",
        cluster.decodes[0].url()
    );
    assert_eq!(
        sample(&metrics, "pd_proxy_backend_requests_total", &dead),
        1.0
    );
}

#[tokio::test]
async fn decode_failing_twice_relays_its_error_and_cancels_prefill() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |_| {}).await;
    cluster.prefill.set(|b| b.delay = Duration::from_secs(20));
    for decode in &cluster.decodes {
        decode.set(|b| *b = Behavior::failing(503, json!({"detail": "overloaded"})));
    }
    let (status, _, text) = cluster
        .post_within(
            "/v1/completions",
            json!({"prompt": "hi"}),
            Duration::from_secs(1),
        )
        .await;
    assert_eq!(status, 503);
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap(),
        json!({"error": {"message": "overloaded", "type": "upstream_error", "param": null, "code": null}})
    );
    let p = cluster.prefill.wait_seen(1).await.remove(0);
    assert_cancelled(&p, Duration::from_secs(1)).await;
    let metrics = cluster.metrics().await;
    assert_eq!(completions_with_outcome(&metrics, "decode_error"), 1.0);
}

#[tokio::test]
async fn decode_client_error_is_relayed_without_retry() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |_| {}).await;
    let refusal =
        json!({"error": {"message": "bad temperature", "type": "BadRequestError", "code": 400}});
    for decode in &cluster.decodes {
        decode.set(|b| *b = Behavior::failing(400, refusal.clone()));
    }
    let (status, _, text) = cluster
        .post("/v1/completions", json!({"prompt": "hi"}))
        .await;
    assert_eq!(status, 400);
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap(),
        json!({"error": {"message": "bad temperature", "type": "invalid_request_error", "param": null, "code": null}})
    );
    let seen: usize = cluster.decodes.iter().map(|d| d.seen().len()).sum();
    assert_eq!(seen, 1);
}

#[tokio::test]
async fn client_going_away_before_the_answer_cancels_both() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    cluster.prefill.set(|b| b.delay = Duration::from_secs(20));
    hang(cluster.decode());
    let impatient = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let result = impatient
        .post(cluster.url("/v1/completions"))
        .json(&json!({"prompt": "hi"}))
        .send()
        .await;
    assert!(result.unwrap_err().is_timeout());
    let p = cluster.prefill.wait_seen(1).await.remove(0);
    let d = cluster.decode().wait_seen(1).await.remove(0);
    assert_cancelled(&p, Duration::from_secs(2)).await;
    assert_cancelled(&d, Duration::from_secs(2)).await;
    let deadline = Instant::now() + WAIT;
    while completions_with_outcome(&cluster.metrics().await, "client_disconnected") != 1.0 {
        assert!(Instant::now() < deadline, "the disconnect was not counted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let metrics = cluster.metrics().await;
    assert_eq!(sample(&metrics, "pd_proxy_backend_in_flight", ""), 0.0);
}

#[tokio::test]
async fn client_going_away_mid_stream_cancels_both() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    cluster.prefill.set(|b| b.delay = Duration::from_secs(20));
    cluster.decode().set(|b| {
        b.chunks = vec![r#"{"choices":[]}"#.to_owned(); 50];
        b.chunk_gap = Duration::from_millis(200);
    });
    let response = cluster
        .stream(json!({"prompt": "hi", "stream": true}))
        .await;
    let mut stream = response.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    drop(stream);
    let p = cluster.prefill.wait_seen(1).await.remove(0);
    let d = cluster.decode().wait_seen(1).await.remove(0);
    assert_cancelled(&p, Duration::from_secs(2)).await;
    assert_cancelled(&d, Duration::from_secs(2)).await;
}

#[tokio::test]
async fn no_ready_pair_answers_503_with_a_clear_message() {
    let (prefill, decode, _bootstrap, proxy) = proxy_with_bootstrap(json!({})).await;
    let client = client();
    let response = client
        .post(format!("{}/v1/completions", proxy.url()))
        .json(&json!({"prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 503);
    let text = response.text().await.unwrap();
    assert!(message(&text).contains("no prefill is ready"), "{text}");
    let ready = client
        .get(format!("{}/ready", proxy.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    assert_eq!(ready.json::<Value>().await.unwrap()["status"], "not_ready");
    assert!(prefill.seen().is_empty() && decode.seen().is_empty());
}

#[tokio::test]
async fn unhealthy_backends_are_skipped() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |config| {
        config.router.health.interval = Duration::from_millis(30);
        config.router.health.failure_threshold = 2;
        config.router.health.success_threshold = 1;
    })
    .await;
    cluster.decodes[0].set_healthy(false);
    let metrics_url = cluster.url("/metrics");
    let label = format!("backend=\"{}\",role=\"decode\"", cluster.decodes[0].url());
    let client = cluster.client.clone();
    let deadline = Instant::now() + WAIT;
    loop {
        let text = client
            .get(&metrics_url)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if sample(&text, "pd_proxy_backend_healthy", &label) == 0.0 {
            break;
        }
        assert!(Instant::now() < deadline, "decode 0 never became unhealthy");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for _ in 0..4 {
        let (status, _, _) = cluster
            .post("/v1/completions", json!({"prompt": "hi"}))
            .await;
        assert_eq!(status, 200);
    }
    assert_eq!(cluster.decodes[0].seen().len(), 0);
    assert_eq!(cluster.decodes[1].seen().len(), 4);

    // No healthy decode: 503. No healthy prefill: 503.
    cluster.decodes[1].set_healthy(false);
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, _, text) = cluster
            .post("/v1/completions", json!({"prompt": "hi"}))
            .await;
        if status == 503 {
            assert!(message(&text).contains("no decode is ready"), "{text}");
            break;
        }
        assert!(Instant::now() < deadline, "never answered 503");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cluster.decodes[1].set_healthy(true);
    cluster.prefill.set_healthy(false);
    let deadline = Instant::now() + WAIT;
    loop {
        let (status, _, text) = cluster
            .post("/v1/completions", json!({"prompt": "hi"}))
            .await;
        if status == 503 && message(&text).contains("no prefill is ready") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the unhealthy prefill was still used"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
