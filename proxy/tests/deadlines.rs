//! Time limits of a request: `--request-timeout` bounds the whole of it (P, D, a retry, the
//! stream), D's first byte is due `--decode-first-byte-timeout` after P's answer, and a retry
//! never repeats a call that ran out of time nor goes back to the decode that failed.

mod common;

use std::time::{Duration, Instant};

use common::*;
use pd_proxy::config::Mode;
use serde_json::{json, Value};

fn message(text: &str) -> String {
    let error: Value = serde_json::from_str(text).unwrap();
    error["error"]["message"].as_str().unwrap().to_owned()
}

/// A request's status, body and how long it took.
async fn timed(cluster: &Cluster, body: Value) -> (u16, String, Duration) {
    let started = Instant::now();
    let (status, _, text) = cluster.post("/v1/completions", body).await;
    (status.as_u16(), text, started.elapsed())
}

#[tokio::test]
async fn a_decode_silent_after_the_prefill_answered_fails_at_its_first_byte_deadline() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |config| {
        config.decode_first_byte_timeout = Duration::from_millis(500)
    })
    .await;
    // P answers at once; D waits for KV that never comes (its side channel is unreachable).
    for decode in &cluster.decodes {
        decode.set(|b| b.delay = Duration::from_secs(60));
    }
    let (status, text, took) = timed(&cluster, json!({"prompt": "hi", "stream": true})).await;
    assert_eq!(status, 504, "{text}");
    assert!(
        message(&text).contains("--decode-first-byte-timeout"),
        "{text}"
    );
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_millis(1500),
        "{took:?}"
    );
    // The call that ran out of time is not made again, on any decode.
    let d = cluster.decodes[0].wait_seen(1).await.remove(0);
    assert!(matches!(d.wait_end().await, End::Cancelled(_)));
    assert!(
        cluster.decodes[1].seen().is_empty(),
        "a timed-out call was retried"
    );
    let metrics = cluster.metrics().await;
    assert_eq!(completions_with_outcome(&metrics, "decode_timeout"), 1.0);
    let timeout = format!(
        "backend=\"{}\",outcome=\"timeout\",role=\"decode\"",
        cluster.decodes[0].url()
    );
    assert_eq!(
        sample(&metrics, "pd_proxy_backend_requests_total", &timeout),
        1.0
    );
}

#[tokio::test]
async fn in_sequential_mode_the_first_byte_is_due_after_the_prefills_answer() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.router.mode = Mode::Sequential;
        config.decode_first_byte_timeout = Duration::from_millis(400);
    })
    .await;
    cluster
        .prefill
        .set(|b| b.delay = Duration::from_millis(500));
    // D's first byte 200 ms after P's answer: in time, though 700 ms after the request came.
    cluster
        .decode()
        .set(|b| b.delay = Duration::from_millis(200));
    let streamed = json!({"prompt": "hi", "stream": true});
    let (status, text, _) = timed(&cluster, streamed.clone()).await;
    assert_eq!(status, 200, "{text}");
    // 600 ms after P's answer: too late.
    cluster
        .decode()
        .set(|b| b.delay = Duration::from_millis(600));
    let (status, text, took) = timed(&cluster, streamed).await;
    assert_eq!(status, 504, "{text}");
    assert!(took < Duration::from_millis(1300), "{took:?}");
}

#[tokio::test]
async fn the_request_timeout_bounds_the_whole_request_retry_included() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |config| {
        config.request_timeout = Duration::from_millis(1500);
        config.decode_first_byte_timeout = Duration::from_secs(10);
    })
    .await;
    // The first decode answers 500 after a second; the retry's decode hangs.
    cluster.decodes[0].set(|b| {
        *b = Behavior::failing(500, json!({"detail": "KV transfer failed"}));
        b.delay = Duration::from_secs(1);
    });
    cluster.decodes[1].set(|b| b.delay = Duration::from_secs(60));
    let (status, text, took) = timed(&cluster, json!({"prompt": "hi"})).await;
    assert_eq!(status, 504, "{text}");
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_millis(2000),
        "{took:?}"
    );
    let retried = cluster.decodes[1].wait_seen(1).await.remove(0);
    assert!(matches!(retried.wait_end().await, End::Cancelled(_)));
}

#[tokio::test]
async fn a_failed_decode_is_never_retried_on_itself() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    cluster
        .decode()
        .set(|b| *b = Behavior::failing(500, json!({"detail": "KV transfer failed"})));
    let (status, text, _) = timed(&cluster, json!({"prompt": "hi"})).await;
    assert_eq!(status, 500, "{text}");
    assert_eq!(
        cluster.decode().seen().len(),
        1,
        "the same decode was asked twice"
    );
}

#[tokio::test]
async fn a_stream_ends_at_the_requests_deadline_counted_from_its_arrival() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.router.mode = Mode::Sequential;
        config.request_timeout = Duration::from_millis(1000);
    })
    .await;
    cluster
        .prefill
        .set(|b| b.delay = Duration::from_millis(400));
    cluster.decode().set(|b| {
        b.chunks = vec![r#"{"choices":[{"text":"t"}]}"#.to_owned(); 40];
        b.chunk_gap = Duration::from_millis(50);
    });
    let started = Instant::now();
    let response = cluster
        .stream(json!({"prompt": "hi", "stream": true}))
        .await;
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    let took = started.elapsed();
    assert!(text.contains("request timeout"), "{text}");
    assert!(
        took >= Duration::from_millis(1000) && took < Duration::from_millis(1300),
        "{took:?}"
    );
}

/// A whole (not streamed) answer's first byte comes only when D has generated all of it, so
/// the first-byte deadline does not apply to it: only the request's.
#[tokio::test]
async fn a_whole_answer_is_bounded_by_the_request_timeout_alone() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.decode_first_byte_timeout = Duration::from_millis(200);
    })
    .await;
    cluster
        .decode()
        .set(|b| b.delay = Duration::from_millis(700));
    let (status, text, _) = timed(&cluster, json!({"prompt": "hi"})).await;
    assert_eq!(status, 200, "{text}");
}
