//! The happy path: what P and D receive, concurrency, streaming, sequential mode, auxiliary
//! routes, API keys and load spreading.

mod common;

use std::time::{Duration, Instant};

use common::*;
use futures_util::StreamExt;
use pd_proxy::config::{Mode, Policy, RoutingConfig};
use serde_json::{json, Value};

fn transfer_id(seen: &Seen) -> String {
    seen.body["kv_transfer_params"]["transfer_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn prefill_and_decode_receive_what_vllms_proxy_sends() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    let request = json!({"model": "mock-model", "prompt": "hi", "max_tokens": 20, "stream": false,
                         "temperature": 0.5, "custom": {"nested": [1, 2.5, null]}});
    let response = cluster
        .client
        .post(cluster.url("/v1/completions"))
        .header("Authorization", "Bearer client-key")
        .header("X-Request-Id", "req-42")
        .header("X-Session-ID", "chat-7")
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-request-id"], "req-42");
    assert_eq!(response.headers()["content-type"], "application/json");
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer, decode_answer());

    let p = cluster.prefill.wait_seen(1).await.remove(0);
    let d = cluster.decode().wait_seen(1).await.remove(0);
    let id = transfer_id(&p);
    let uuid = id.strip_prefix("xfer-").expect("xfer- prefix");
    assert_eq!(uuid.len(), 36, "{id}");
    assert_eq!(uuid.as_bytes()[14], b'4', "a uuid4: {id}");
    assert_eq!(p.path, "/v1/completions");
    assert_eq!(
        p.body,
        json!({"model": "mock-model", "prompt": "hi", "max_tokens": 1, "stream": false,
               "temperature": 0.5, "custom": {"nested": [1, 2.5, null]}, "min_tokens": 1,
               "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                                      "transfer_id": id}})
    );
    assert_eq!(
        d.body,
        json!({"model": "mock-model", "prompt": "hi", "max_tokens": 20, "stream": false,
               "temperature": 0.5, "custom": {"nested": [1, 2.5, null]},
               "kv_transfer_params": {"do_remote_decode": false, "do_remote_prefill": true,
                                      "remote_bootstrap_addr": cluster.bootstrap.url(),
                                      "remote_engine_id": "engine-0", "transfer_id": id}})
    );
    for seen in [&p, &d] {
        assert_eq!(seen.header("x-request-id").as_deref(), Some("req-42"));
        assert_eq!(seen.header("x-session-id").as_deref(), Some("chat-7"));
        assert_eq!(
            seen.header("authorization").as_deref(),
            Some("Bearer client-key")
        );
        assert_eq!(
            seen.header("content-type").as_deref(),
            Some("application/json")
        );
    }
    assert_eq!(p.header("x-data-parallel-rank").as_deref(), Some("0"));
    assert_eq!(d.header("x-data-parallel-rank"), None);
}

#[tokio::test]
async fn streamed_chat_keeps_sse_and_prefill_loses_stream_options() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    let request = json!({"model": "mock-model", "messages": [{"role": "user", "content": "hi"}],
                         "stream": true, "stream_options": {"include_usage": true},
                         "max_completion_tokens": 30});
    let (status, headers, text) = cluster.post("/v1/chat/completions", request).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/event-stream");
    assert_eq!(
        text,
        "data: {\"choices\":[{\"index\":0,\"text\":\"Hel\"}]}\n\n\
         data: {\"choices\":[{\"index\":0,\"text\":\"lo\"}]}\n\ndata: [DONE]\n\n"
    );
    let p = cluster.prefill.wait_seen(1).await.remove(0);
    let d = cluster.decode().wait_seen(1).await.remove(0);
    assert_eq!(p.path, "/v1/chat/completions");
    assert_eq!(d.path, "/v1/chat/completions");
    assert_eq!(p.body["stream"], false);
    assert_eq!(p.body["max_tokens"], 1);
    assert_eq!(p.body["max_completion_tokens"], 1);
    assert!(p.body.get("stream_options").is_none());
    assert_eq!(d.body["stream"], true);
    assert_eq!(d.body["stream_options"], json!({"include_usage": true}));
    assert_eq!(d.body["max_completion_tokens"], 30);
    assert!(d.body.get("max_tokens").is_none());
}

#[tokio::test]
async fn a_stream_asked_for_the_way_vllm_reads_it_is_streamed() {
    // vLLM's pydantic reads `stream` laxly: `"yes"`, `1` and `"TRUE"` all stream, and so must
    // the proxy (which follows a streamed answer to migrate it: D is asked for token ids).
    for asked in [json!(true), json!("yes"), json!(1), json!("TRUE")] {
        let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
        let request = json!({"model": "mock-model", "messages": [{"role": "user", "content": "hi"}],
                             "stream": asked, "max_completion_tokens": 30});
        let (status, headers, text) = cluster.post("/v1/chat/completions", request).await;
        assert_eq!(status, 200, "{asked}: {text}");
        assert_eq!(headers["content-type"], "text/event-stream", "{asked}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{asked}: {text}");
        let p = cluster.prefill.wait_seen(1).await.remove(0);
        let d = cluster.decode().wait_seen(1).await.remove(0);
        assert_eq!(p.body["stream"], false, "{asked}");
        assert_eq!(d.body["stream"], asked);
        assert_eq!(
            d.body["return_token_ids"], true,
            "{asked}: followed as a stream"
        );
    }
    // A value the engine would refuse is left for it to refuse, not replaced by the proxy's.
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    let request = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true,
                         "return_token_ids": "maybe"});
    cluster.post("/v1/chat/completions", request).await;
    let d = cluster.decode().wait_seen(1).await.remove(0);
    assert_eq!(d.body["return_token_ids"], "maybe");
}

#[tokio::test]
async fn no_authorization_is_invented_and_a_request_id_is_made() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    let (status, headers, _) = cluster
        .post("/v1/completions", json!({"prompt": "hi"}))
        .await;
    assert_eq!(status, 200);
    let id = headers["x-request-id"].to_str().unwrap().to_owned();
    assert_eq!(id.len(), 36);
    let p = cluster.prefill.wait_seen(1).await.remove(0);
    let d = cluster.decode().wait_seen(1).await.remove(0);
    for seen in [&p, &d] {
        assert_eq!(seen.header("authorization"), None);
        assert_eq!(seen.header("x-request-id"), Some(id.clone()));
    }
    assert_eq!(transfer_id(&p), transfer_id(&d));
}

#[tokio::test]
async fn decode_starts_before_prefill_answers() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    cluster
        .prefill
        .set(|b| b.delay = Duration::from_millis(800));
    cluster
        .decode()
        .set(|b| b.delay = Duration::from_millis(900));
    let started = Instant::now();
    let (status, _, _) = cluster
        .post("/v1/completions", json!({"prompt": "hi"}))
        .await;
    assert_eq!(status, 200);
    let p = cluster.prefill.wait_seen(1).await.remove(0);
    let d = cluster.decode().wait_seen(1).await.remove(0);
    let End::Finished(p_answered) = p.wait_end().await else {
        panic!("P was cancelled")
    };
    assert!(d.at < p_answered, "D started after P answered");
    assert!(
        d.at.duration_since(started) < Duration::from_millis(300),
        "D started {:?} after the request",
        d.at.duration_since(started)
    );
    // Both ran side by side: the whole request took about D's time, not P's plus D's.
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn streamed_chunks_reach_the_client_before_decode_finishes() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    cluster
        .decode()
        .set(|b| b.chunk_gap = Duration::from_millis(400));
    let started = Instant::now();
    let response = cluster
        .stream(json!({"prompt": "hi", "stream": true}))
        .await;
    assert_eq!(response.status(), 200);
    let mut stream = response.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    let first_at = started.elapsed();
    assert!(first.starts_with(b"data: {"), "{first:?}");
    assert!(
        first_at < Duration::from_millis(300),
        "first chunk after {first_at:?}"
    );
    let d = cluster.decode().wait_seen(1).await.remove(0);
    assert_eq!(
        d.end(),
        None,
        "D had finished before the first chunk arrived"
    );
    let mut rest = Vec::new();
    while let Some(chunk) = stream.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    assert!(started.elapsed() >= Duration::from_millis(800));
    assert!(rest.ends_with(b"data: [DONE]\n\n"));
    assert!(matches!(d.wait_end().await, End::Finished(_)));
}

#[tokio::test]
async fn sequential_mode_hands_prefills_params_to_decode() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.router.mode = Mode::Sequential
    })
    .await;
    cluster
        .prefill
        .set(|b| b.delay = Duration::from_millis(200));
    let (status, _, text) = cluster
        .post("/v1/completions", json!({"prompt": "hi", "max_tokens": 9}))
        .await;
    assert_eq!(status, 200, "{text}");
    let p = cluster.prefill.wait_seen(1).await.remove(0);
    let d = cluster.decode().wait_seen(1).await.remove(0);
    let End::Finished(p_answered) = p.wait_end().await else {
        panic!("P was cancelled")
    };
    assert!(d.at >= p_answered, "D started before P answered");
    let id = transfer_id(&p);
    assert_eq!(
        p.body["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false, "transfer_id": id,
               "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
               "remote_port": null})
    );
    assert_eq!(p.body["max_tokens"], 1);
    assert_eq!(
        d.body["kv_transfer_params"],
        prefill_answer()["kv_transfer_params"]
    );
    assert_eq!(d.body["max_tokens"], 9);
}

#[tokio::test]
async fn sequential_mode_refuses_a_prefill_answer_without_params() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.router.mode = Mode::Sequential
    })
    .await;
    cluster.prefill.set(|b| b.json = json!({"choices": []}));
    let (status, _, text) = cluster
        .post("/v1/completions", json!({"prompt": "hi"}))
        .await;
    assert_eq!(status, 502);
    let error: Value = serde_json::from_str(&text).unwrap();
    assert!(error["error"]["message"]
        .as_str()
        .unwrap()
        .contains("without kv_transfer_params"));
    assert!(cluster.decode().seen().is_empty());
}

#[tokio::test]
async fn api_key_is_required_and_forwarded() {
    // The metrics read below are left open to scrapers (a key is set).
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.api_key = Some("secret".into());
        config.metrics_open = true;
    })
    .await;
    for auth in [None, Some("Bearer wrong"), Some("secret")] {
        let mut request = cluster
            .client
            .post(cluster.url("/v1/completions"))
            .json(&json!({"prompt": "hi"}));
        if let Some(auth) = auth {
            request = request.header("Authorization", auth);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 401, "{auth:?}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["type"], "authentication_error");
        assert_eq!(error["error"]["code"], "invalid_api_key");
    }
    let models = cluster
        .client
        .get(cluster.url("/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 401);
    assert!(cluster.prefill.seen().is_empty() && cluster.decode().seen().is_empty());
    let response = cluster
        .client
        .post(cluster.url("/v1/completions"))
        .bearer_auth("secret")
        .json(&json!({"prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let d = cluster.decode().wait_seen(1).await.remove(0);
    assert_eq!(d.header("authorization").as_deref(), Some("Bearer secret"));
    let metrics = cluster.metrics().await;
    assert_eq!(completions_with_outcome(&metrics, "unauthorized"), 3.0);
}

#[tokio::test]
async fn models_health_ready_and_metrics_answer() {
    let cluster = Cluster::start(1, &[(0, "engine-0"), (2, "engine-2")], |_| {}).await;
    let (_, models) = cluster.get_json("/v1/models").await;
    assert_eq!(models["data"][0]["id"], "mock-model");
    assert_eq!(
        cluster.get_json("/health").await,
        (reqwest::StatusCode::OK, json!({"status": "ok"}))
    );
    let (_, ready) = cluster.get_json("/ready").await;
    assert_eq!(ready["status"], "ready");
    assert_eq!(ready["ready_pairs"], 2);
    assert_eq!(
        ready["prefills"][0]["dp_ranks"],
        json!({"0": "engine-0", "2": "engine-2"})
    );
    assert_eq!(
        ready["prefills"][0]["bootstrap_addr"],
        cluster.bootstrap.url()
    );

    for stream in [false, true] {
        let (status, _, _) = cluster
            .post("/v1/completions", json!({"prompt": "hi", "stream": stream}))
            .await;
        assert_eq!(status, 200);
    }
    let metrics = cluster.metrics().await;
    assert_eq!(completions_with_outcome(&metrics, "ok"), 2.0);
    let decode = format!(
        "backend=\"{}\",outcome=\"ok\",role=\"decode\"",
        cluster.decode().url()
    );
    // Two completions (the proxy answers /v1/models from what the engines listed).
    assert_eq!(
        sample(&metrics, "pd_proxy_backend_requests_total", &decode),
        2.0
    );
    assert_eq!(
        sample(
            &metrics,
            "pd_proxy_time_to_first_byte_seconds_count",
            "route=\"/v1/completions\""
        ),
        2.0
    );
    assert_eq!(
        sample(
            &metrics,
            "pd_proxy_overhead_seconds_count",
            "route=\"/v1/completions\""
        ),
        2.0
    );
    assert_eq!(
        sample(
            &metrics,
            "pd_proxy_request_duration_seconds_count",
            "route=\"/v1/completions\""
        ),
        2.0
    );
    assert_eq!(
        sample(&metrics, "pd_proxy_backend_healthy", "role=\"decode\""),
        1.0
    );
    assert_eq!(sample(&metrics, "pd_proxy_prefill_dp_ranks", ""), 2.0);
    assert_eq!(
        sample(&metrics, "pd_proxy_backend_in_flight", "role=\"decode\""),
        0.0
    );
    assert!(metrics.contains("pd_proxy_discoveries_total"));
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    let response = cluster
        .client
        .post(cluster.url("/v1/completions"))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["type"], "invalid_request_error");
    let (status, _, _) = cluster.post("/v1/completions", json!([1, 2])).await;
    assert_eq!(status, 400);
    let (status, _, text) = cluster.post("/v1/nothing", json!({})).await;
    assert_eq!(status, 404);
    assert!(text.contains("no route for POST /v1/nothing"), "{text}");
    let response = cluster
        .client
        .get(cluster.url("/v1/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 405);
    assert!(cluster.prefill.seen().is_empty());
}

#[tokio::test]
async fn round_robin_spreads_pairs_and_decodes_evenly() {
    let cluster = Cluster::start(3, &[(0, "engine-0"), (5, "engine-5")], |_| {}).await;
    for _ in 0..12 {
        let (status, _, _) = cluster
            .post("/v1/completions", json!({"prompt": "hi"}))
            .await;
        assert_eq!(status, 200);
    }
    for decode in &cluster.decodes {
        assert_eq!(decode.seen().len(), 4);
    }
    let ranks: Vec<String> = cluster
        .prefill
        .seen()
        .iter()
        .map(|seen| seen.header("x-data-parallel-rank").unwrap())
        .collect();
    assert_eq!(ranks.iter().filter(|r| *r == "0").count(), 6);
    assert_eq!(ranks.iter().filter(|r| *r == "5").count(), 6);
}

#[tokio::test]
async fn least_loaded_sends_new_requests_to_the_idle_decode() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |config| {
        config.router.routing = RoutingConfig::with_policy(Policy::LeastLoaded)
    })
    .await;
    for decode in &cluster.decodes {
        decode.set(|b| b.delay = Duration::from_millis(1500));
    }
    let client = cluster.client.clone();
    let url = cluster.url("/v1/completions");
    let long = tokio::spawn(async move {
        client
            .post(url)
            .json(&json!({"prompt": "long"}))
            .send()
            .await
            .unwrap()
            .status()
    });
    eventually("the long request to reach a decode", || {
        cluster.decodes.iter().any(|d| !d.seen().is_empty())
    })
    .await;
    let busy = cluster
        .decodes
        .iter()
        .position(|d| !d.seen().is_empty())
        .unwrap();
    for decode in &cluster.decodes {
        decode.set(|b| b.delay = Duration::ZERO);
    }
    for _ in 0..6 {
        let (status, _, _) = cluster
            .post("/v1/completions", json!({"prompt": "hi"}))
            .await;
        assert_eq!(status, 200);
    }
    assert_eq!(
        cluster.decodes[busy].seen().len(),
        1,
        "a request went to the busy decode"
    );
    assert_eq!(cluster.decodes[1 - busy].seen().len(), 6);
    assert_eq!(long.await.unwrap(), 200);
}
