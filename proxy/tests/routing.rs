//! The request-aware policies and conditional disaggregation, through a real proxy in front of
//! mock P and D servers: where each request went, what P and D received, the decision counters
//! and the `x-pd-route` header.

mod common;

use common::*;
use pd_proxy::config::Fallback;
use pd_proxy::config::{Policy, RoutingConfig};
use serde_json::json;

/// A prompt of `blocks` 64-byte blocks of `system`, then `turn`.
fn prompt(system: char, blocks: usize, turn: &str) -> String {
    format!("{}{turn}", system.to_string().repeat(64 * blocks))
}

fn decode_of(cluster: &Cluster, seen_before: &[usize]) -> usize {
    let now: Vec<usize> = cluster.decodes.iter().map(|d| d.seen().len()).collect();
    let changed: Vec<usize> = (0..now.len())
        .filter(|&i| now[i] != seen_before[i])
        .collect();
    assert_eq!(changed.len(), 1, "{seen_before:?} -> {now:?}");
    changed[0]
}

fn seen_counts(cluster: &Cluster) -> Vec<usize> {
    cluster.decodes.iter().map(|d| d.seen().len()).collect()
}

fn decisions(metrics: &str, decision: &str, reason: &str) -> u64 {
    let labels = format!("decision=\"{decision}\",model=");
    let reason = format!("reason=\"{reason}\"}}");
    let lines = metrics.lines().filter(|line| line.contains(&reason));
    let text: String = lines.collect::<Vec<_>>().join("\n");
    sample(&text, "pd_proxy_route_decisions_total", &labels) as u64
}

#[tokio::test]
async fn cache_aware_sends_a_conversation_back_to_the_decode_that_holds_it() {
    let cluster = Cluster::start(4, &[(0, "engine-0")], |config| {
        config.router.routing = RoutingConfig::with_policy(Policy::CacheAware)
    })
    .await;
    let mut homes = Vec::new();
    for system in ['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'] {
        let mut home = None;
        for turn in 0..4 {
            let before = seen_counts(&cluster);
            let text = prompt(system, 20, &"turn ".repeat(turn + 1));
            let (status, _, _) = cluster
                .post("/v1/completions", json!({"prompt": text, "max_tokens": 4}))
                .await;
            assert_eq!(status, 200);
            let decode = decode_of(&cluster, &before);
            assert_eq!(
                *home.get_or_insert(decode),
                decode,
                "system prompt {system} moved"
            );
        }
        homes.push(home.unwrap());
    }
    // New conversations went by load: more than one decode holds some.
    homes.sort();
    homes.dedup();
    assert!(homes.len() > 1, "every conversation on one decode");
}

#[tokio::test]
async fn consistent_hash_keeps_a_session_on_one_decode() {
    let cluster = Cluster::start(4, &[(0, "engine-0")], |config| {
        config.router.routing = RoutingConfig::with_policy(Policy::ConsistentHash)
    })
    .await;
    let mut homes = Vec::new();
    for session in 0..12 {
        let mut home = None;
        for turn in 0..3 {
            let before = seen_counts(&cluster);
            let status = cluster
                .client
                .post(cluster.url("/v1/chat/completions"))
                .header("x-session-id", format!("chat-{session}"))
                .json(&json!({"messages": [{"role": "user", "content": format!("turn {turn}")}]}))
                .send()
                .await
                .unwrap()
                .status();
            assert_eq!(status, 200);
            let decode = decode_of(&cluster, &before);
            assert_eq!(
                *home.get_or_insert(decode),
                decode,
                "session {session} moved"
            );
        }
        homes.push(home.unwrap());
    }
    homes.sort();
    homes.dedup();
    assert!(homes.len() >= 2, "12 sessions on one decode");
    // The body's `user` is the key when there is no header.
    let mut home = None;
    for _ in 0..3 {
        let before = seen_counts(&cluster);
        let body = json!({"prompt": "hi", "user": "user-7"});
        assert_eq!(cluster.post("/v1/completions", body).await.0, 200);
        let decode = decode_of(&cluster, &before);
        assert_eq!(*home.get_or_insert(decode), decode);
    }
}

#[tokio::test]
async fn short_prompts_go_to_a_decode_alone_and_say_why() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.router.routing.decode_only.below_chars = 100;
    })
    .await;
    let response = cluster
        .client
        .post(cluster.url("/v1/completions"))
        .header("x-pd-route", "1")
        .json(&json!({"prompt": "short", "max_tokens": 4,
                      "kv_transfer_params": {"do_remote_prefill": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let route = response.headers()["x-pd-route"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        route,
        format!(
            "decision=decode_only; reason=short_prompt; decode={}",
            cluster.decode().url()
        )
    );
    // P never saw it; D got the client's body without transfer instructions.
    assert!(cluster.prefill.seen().is_empty());
    let seen = cluster.decode().wait_seen(1).await;
    assert_eq!(seen[0].body["prompt"], "short");
    assert!(
        seen[0].body.get("kv_transfer_params").is_none(),
        "{}",
        seen[0].body
    );

    // A long prompt goes through P and D; without asking, no header.
    let (status, headers, _) = cluster
        .post(
            "/v1/completions",
            json!({"prompt": "x".repeat(200), "max_tokens": 4}),
        )
        .await;
    assert_eq!(status, 200);
    assert!(!headers.contains_key("x-pd-route"));
    assert_eq!(cluster.prefill.wait_seen(1).await.len(), 1);
    let metrics = cluster.metrics().await;
    assert_eq!(decisions(&metrics, "decode_only", "short_prompt"), 1);
    assert_eq!(decisions(&metrics, "disaggregated", "long_prompt"), 1);
    // The phases: P answered once, D's first byte came twice.
    let count = |name: &str| {
        let series = format!("{name}_count");
        sample(&metrics, &series, "route=\"/v1/completions\"") as u64
    };
    assert_eq!(count("pd_proxy_prefill_duration_seconds"), 1);
    assert_eq!(count("pd_proxy_decode_first_byte_seconds"), 2);
}

#[tokio::test]
async fn several_samples_of_a_prompt_go_to_a_decode_alone_and_say_why() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    let completion = json!({"prompt": "x".repeat(200), "max_tokens": 4, "n": 2});
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "best_of": "2"});
    for (path, body) in [
        ("/v1/completions", completion),
        ("/v1/chat/completions", chat),
    ] {
        let response = cluster
            .client
            .post(cluster.url(path))
            .header("x-pd-route", "1")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{path}");
        let route = response.headers()["x-pd-route"].to_str().unwrap();
        let expected = "decision=decode_only; reason=parallel_sampling; decode=";
        assert_eq!(route, format!("{expected}{}", cluster.decode().url()));
    }
    // P never saw them; D got each body as sent, without transfer instructions.
    assert!(cluster.prefill.seen().is_empty());
    let seen = cluster.decode().wait_seen(2).await;
    assert_eq!(
        (&seen[0].body["n"], &seen[1].body["best_of"]),
        (&json!(2), &json!("2"))
    );
    assert!(seen
        .iter()
        .all(|s| s.body.get("kv_transfer_params").is_none()));
    let metrics = cluster.metrics().await;
    assert_eq!(decisions(&metrics, "decode_only", "parallel_sampling"), 2);
    // One sample goes through P and D as ever.
    let one = json!({"prompt": "x".repeat(200), "max_tokens": 4, "n": 1});
    assert_eq!(cluster.post("/v1/completions", one).await.0, 200);
    assert_eq!(cluster.prefill.wait_seen(1).await.len(), 1);
}

#[tokio::test]
async fn a_prompt_a_decode_already_holds_skips_prefill() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |config| {
        config.router.routing.decode_policy = Policy::CacheAware;
        config.router.routing.decode_only.prefix_share = Some(0.8);
    })
    .await;
    let first = prompt('s', 30, "first question");
    assert_eq!(
        cluster
            .post("/v1/completions", json!({"prompt": first}))
            .await
            .0,
        200
    );
    assert_eq!(cluster.prefill.seen().len(), 1);
    // The same conversation, one turn on: the decode that served it holds > 80% of it.
    let before = seen_counts(&cluster);
    let next = prompt('s', 30, "first question, and a follow-up");
    let (status, headers, _) = {
        let response = cluster
            .client
            .post(cluster.url("/v1/completions"))
            .header("x-pd-route", "1")
            .json(&json!({"prompt": next}))
            .send()
            .await
            .unwrap();
        (response.status(), response.headers().clone(), ())
    };
    assert_eq!(status, 200);
    let route = headers["x-pd-route"].to_str().unwrap();
    assert!(
        route.starts_with("decision=decode_only; reason=prefix_hit"),
        "{route}"
    );
    assert_eq!(
        cluster.prefill.seen().len(),
        1,
        "P was called for a held prompt"
    );
    let decode = decode_of(&cluster, &before);
    assert_eq!(
        cluster.decodes[decode].seen().len(),
        2,
        "another decode served the follow-up"
    );
    // An unrelated prompt is cold everywhere: through P.
    assert_eq!(
        cluster
            .post("/v1/completions", json!({"prompt": prompt('z', 30, "")}))
            .await
            .0,
        200
    );
    assert_eq!(cluster.prefill.seen().len(), 2);
    assert_eq!(
        decisions(&cluster.metrics().await, "decode_only", "prefix_hit"),
        1
    );
}

#[tokio::test]
async fn without_a_healthy_prefill_decode_only_needs_the_operators_consent() {
    for fallback in [Fallback::None, Fallback::DecodeOnly] {
        let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
            config.router.routing.decode_only.fallback = fallback;
            config.router.health.interval = std::time::Duration::from_millis(50);
            config.router.health.failure_threshold = 1;
        })
        .await;
        cluster.prefill.set_healthy(false);
        eventually("the prefill to be marked unhealthy", || {
            cluster
                .prefill
                .state
                .health_checks
                .load(std::sync::atomic::Ordering::SeqCst)
                > 2
        })
        .await;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let (status, _, body) = cluster
            .post(
                "/v1/completions",
                json!({"prompt": "hello", "max_tokens": 4}),
            )
            .await;
        let metrics = cluster.metrics().await;
        match fallback {
            Fallback::None => {
                assert_eq!(status, 503, "{body}");
                assert!(body.contains("no prefill is ready"), "{body}");
                assert!(cluster.decode().seen().is_empty());
                assert_eq!(decisions(&metrics, "refused", "no_prefill_healthy"), 1);
            }
            Fallback::DecodeOnly => {
                assert_eq!(status, 200, "{body}");
                assert_eq!(cluster.decode().seen().len(), 1);
                assert_eq!(decisions(&metrics, "decode_only", "no_prefill_healthy"), 1);
            }
        }
        assert!(cluster.prefill.seen().is_empty());
    }
}

#[tokio::test]
async fn the_load_engines_report_steers_least_loaded_away_from_a_busy_decode() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |config| {
        config.router.routing = RoutingConfig::with_policy(Policy::LeastLoaded);
        config.router.engine_metrics_interval = Some(std::time::Duration::from_millis(50));
    })
    .await;
    // Busy with another proxy's traffic: 40 running and waiting over two dp ranks.
    cluster.decodes[0].set_metrics(
        "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 30.0\n\
         vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 10.0\n",
    );
    cluster.decodes[1]
        .set_metrics("vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n");
    let busy = format!("backend=\"{}\"", cluster.decodes[0].url());
    let deadline = std::time::Instant::now() + WAIT;
    while sample(
        &cluster.metrics().await,
        "pd_proxy_backend_engine_load",
        &busy,
    ) != 40.0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the load was not read"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    cluster.complete(10).await;
    assert!(
        cluster.decodes[0].seen().is_empty(),
        "a request went to the busy decode"
    );
    // The prefill has no /metrics: its load stays this proxy's own count.
    let prefill = format!("backend=\"{}\"", cluster.prefill.url());
    assert_eq!(
        sample(
            &cluster.metrics().await,
            "pd_proxy_backend_engine_load",
            &prefill
        ),
        -1.0
    );
}

/// An engine is saturated from its own signals: requests waiting in its scheduler, or its KV
/// cache (nearly) full, past the thresholds; back when they fall. The proxy shows it per
/// backend on `/metrics`, and `GET /ready` says when every decode is.
#[tokio::test]
async fn an_engine_saturates_on_its_waiting_requests_and_its_kv_cache() {
    let cluster = Cluster::start(2, &[(0, "engine-0")], |config| {
        config.router.engine_metrics_interval = Some(std::time::Duration::from_millis(50));
        config.router.saturation.waiting = 4;
        config.router.saturation.kv_usage = 0.9;
    })
    .await;
    let saturated = |metrics: &str, i: usize| {
        let backend = format!("backend=\"{}\"", cluster.decodes[i].url());
        sample(metrics, "pd_proxy_backend_saturated", &backend)
    };
    let wait_for = |expected: [f64; 2]| {
        let cluster = &cluster;
        async move {
            let deadline = std::time::Instant::now() + WAIT;
            loop {
                let metrics = cluster.metrics().await;
                if [saturated(&metrics, 0), saturated(&metrics, 1)] == expected {
                    return;
                }
                assert!(std::time::Instant::now() < deadline, "never {expected:?}");
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
    };
    let decodes_saturated = || async {
        let ready: serde_json::Value = (cluster.client.get(cluster.url("/ready")).send().await)
            .unwrap()
            .json()
            .await
            .unwrap();
        ready["saturated"]["decodes"].clone()
    };
    cluster.decodes[0].set_metrics("vllm:num_requests_waiting{engine=\"0\"} 4.0\n");
    cluster.decodes[1].set_metrics("vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n");
    wait_for([1.0, 0.0]).await;
    assert_eq!(decodes_saturated().await, false);
    cluster.decodes[1].set_metrics("vllm:kv_cache_usage_perc{engine=\"0\"} 0.95\n");
    wait_for([1.0, 1.0]).await;
    assert_eq!(decodes_saturated().await, true);
    cluster.decodes[0].set_metrics("vllm:num_requests_waiting{engine=\"0\"} 0.0\n");
    wait_for([0.0, 1.0]).await;
}
