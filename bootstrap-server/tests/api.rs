//! Wire compatibility of every route with vLLM's Mooncake clients, against the real server.

mod common;

use bootstrap_server::registry::{EngineConflictPolicy, ExpectedTopology};
use common::{start, start_with};
use reqwest::{Method, StatusCode};
use serde_json::json;

async fn engine_keyed_registration_and_query() {
    let server = start().await;
    assert_eq!(server.get("/query").await, (StatusCode::OK, json!({})));
    let ok = (StatusCode::OK, json!({"status": "ok"}));
    assert_eq!(
        server.register("e0", 0, 0, 0, "tcp://10.0.0.5:41231").await,
        ok
    );
    assert_eq!(
        server.register("e0", 0, 1, 0, "tcp://10.0.0.5:41232").await,
        ok
    );
    assert_eq!(
        server.register("e1", 3, 0, 0, "tcp://10.0.0.6:41231").await,
        ok
    );
    // An identical replay succeeds (clients retry after timeouts).
    assert_eq!(
        server.register("e0", 0, 0, 0, "tcp://10.0.0.5:41231").await,
        ok
    );

    let expected = json!({
        "0": {"engine_id": "e0", "worker_addr": {"0": {"0": "tcp://10.0.0.5:41231"}, "1": {"0": "tcp://10.0.0.5:41232"}}},
        "3": {"engine_id": "e1", "worker_addr": {"0": {"0": "tcp://10.0.0.6:41231"}}}
    });
    assert_eq!(
        server.get("/query").await,
        (StatusCode::OK, expected.clone())
    );
    assert_eq!(
        server.get("/query?engine_id=e1").await,
        (StatusCode::OK, json!({"3": expected["3"].clone()}))
    );
    let (status, body) = server.get("/query?engine_id=nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(body["detail"].as_str().unwrap().contains("nope"));
}

async fn conflicts_use_vllm_wording() {
    let server = start_with(|c| c.registry.engine_conflict = EngineConflictPolicy::Reject).await;
    server.register("A", 0, 0, 0, "tcp://h:1").await;
    assert_eq!(
        server.register("B", 0, 1, 0, "tcp://h:2").await,
        (
            StatusCode::BAD_REQUEST,
            json!({"detail": "Engine ID mismatch for dp_rank=0: expected A, got B"})
        )
    );
    assert_eq!(
        server.register("A", 0, 0, 0, "tcp://h:9").await,
        (
            StatusCode::BAD_REQUEST,
            json!({"detail": "Worker with dp_rank=0, tp_rank=0, pp_rank=0 is already registered at tcp://h:1, but still want to register at tcp://h:9"})
        )
    );
}

async fn a_restarted_engine_takes_its_ranks_back() {
    let server = start_with(|c| c.registry.engine_conflict = EngineConflictPolicy::Reject).await;
    server.register("old", 0, 0, 0, "tcp://h:1").await;
    server.register("old", 0, 1, 0, "tcp://h:2").await;
    server.register("other", 1, 0, 0, "tcp://h:3").await;

    // Rule 1: "replace": true takes the dp rank over even under the reject policy; the old
    // engine leaves whole.
    let (status, _) = server
        .post(
            "/register",
            json!({"engine_id": "new", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:7", "replace": true}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (_, topology) = server.get("/query").await;
    assert_eq!(
        topology["0"],
        json!({"engine_id": "new", "worker_addr": {"0": {"0": "tcp://h:7"}}})
    );
    assert_eq!(topology["1"]["engine_id"], "other");

    // Rule 2: once an engine deregistered, a new id registers plainly.
    let (status, body) = server.deregister(json!({"engine_id": "other"})).await;
    assert_eq!(
        (status, body),
        (StatusCode::OK, json!({"status": "ok", "removed": 1}))
    );
    assert_eq!(
        server.register("newer", 1, 0, 0, "tcp://h:8").await.0,
        StatusCode::OK
    );

    // Deregistering one slot of an engine leaves the rest.
    let (_, body) = server
        .deregister(json!({"engine_id": "newer", "tp_rank": 5}))
        .await;
    assert_eq!(body["removed"], 0);
}

async fn takeover_is_the_default_so_stock_vllm_restarts() {
    let server = start().await;
    server.register("old", 0, 0, 0, "tcp://h:1").await;
    server.register("old", 0, 1, 0, "tcp://h:2").await;
    // A restarted P with a new engine id (vLLM's default).
    assert_eq!(
        server.register("new", 0, 1, 0, "tcp://n:2").await,
        (StatusCode::OK, json!({"status": "ok"}))
    );
    // The old engine's remaining rank left with it, and the new one is not shown until its
    // ranks are whole: a D would take its tp size from tp rank 1 alone.
    let (status, body) = server.get("/query").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("new (1 ranks so far, incomplete)"),
        "{body}"
    );
    server.register("new", 0, 0, 0, "tcp://n:1").await;
    let (_, topology) = server.get("/query").await;
    assert_eq!(
        topology,
        json!({"0": {"engine_id": "new", "worker_addr": {"0": {"0": "tcp://n:1"}, "1": {"0": "tcp://n:2"}}}})
    );
    // A restarted P with a pinned engine id: new addresses.
    assert_eq!(
        server.register("new", 0, 0, 0, "tcp://m:1").await.0,
        StatusCode::OK
    );
    let (_, topology) = server.get("/query").await;
    assert_eq!(
        topology,
        json!({"0": {"engine_id": "new", "worker_addr": {"0": {"0": "tcp://m:1"}}}})
    );
    // Native clients can refuse a takeover.
    let (status, body) = server
        .post(
            "/register",
            json!({"engine_id": "x", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://x:1", "replace": false}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body["detail"]
        .as_str()
        .unwrap()
        .contains("Engine ID mismatch"));
    let metrics = server.metrics().await;
    assert!(
        metrics.contains("bootstrap_engine_takeovers_total 2"),
        "{metrics}"
    );
}

async fn expected_topology_gates_query_and_ranks() {
    let server = start_with(|c| {
        c.registry.expected = Some(ExpectedTopology {
            dp_size: 2,
            tp_size: 2,
            pp_size: 1,
        })
    })
    .await;
    let (status, body) = server.get("/query").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        body["detail"],
        "Mooncake prefiller worker topology is not ready: 4 of 4 workers have not registered."
    );
    let (status, body) = server.get("/ready").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["missing"], 4);
    let gauges = |metrics: &str| -> Vec<String> {
        (metrics.lines())
            .filter(|l| l.starts_with("bootstrap_topology_"))
            .filter(|l| !l.starts_with("bootstrap_topology_revision"))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(
        gauges(&server.metrics().await),
        [
            "bootstrap_topology_expected_workers 4",
            "bootstrap_topology_missing_workers 4",
            "bootstrap_topology_ready 0"
        ]
    );

    assert_eq!(
        server.register("e", 0, 2, 0, "tcp://h:1").await,
        (
            StatusCode::BAD_REQUEST,
            json!({"detail": "TP rank 2 must be less than TP size 2."})
        )
    );
    assert_eq!(
        server.register("e", 2, 0, 0, "tcp://h:1").await,
        (
            StatusCode::BAD_REQUEST,
            json!({"detail": "DP rank 2 must be less than DP size 2."})
        )
    );
    for (dp, tp) in [(0, 0), (0, 1), (1, 0)] {
        server
            .register("e", dp, tp, 0, &format!("tcp://h:{}", 10 + dp * 2 + tp))
            .await;
    }
    let (status, body) = server.get("/query").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body["detail"].as_str().unwrap().contains("1 of 4"));
    server.register("e", 1, 1, 0, "tcp://h:13").await;
    assert_eq!(server.get("/query").await.0, StatusCode::OK);
    assert_eq!(
        gauges(&server.metrics().await),
        [
            "bootstrap_topology_expected_workers 4",
            "bootstrap_topology_missing_workers 0",
            "bootstrap_topology_ready 1"
        ]
    );
    assert_eq!(
        server.get("/ready").await,
        (
            StatusCode::OK,
            json!({"status": "ready", "registered": 4, "expected": 4, "missing": 0})
        )
    );
}

async fn request_keyed_api() {
    let server = start().await;
    let ok = (StatusCode::OK, json!({"status": "ok"}));
    for tp in 0..2 {
        let body =
            json!({"dp_rank": 0, "tp_rank": tp, "worker_addr": format!("tcp://p:{}", 100 + tp)});
        assert_eq!(server.post("/register_worker", body).await, ok);
    }
    let register = |id: &str, dp: u32| json!({"req_id": id, "dp_rank": dp});
    assert_eq!(
        server.post("/register_request", register("r1", 0)).await,
        ok
    );
    assert_eq!(
        server.post("/register_request", register("r1", 0)).await,
        ok,
        "replay"
    );
    assert_eq!(
        server.post("/register_request", register("r1", 1)).await,
        (
            StatusCode::BAD_REQUEST,
            json!({"detail": "Request 'r1' already registered with rank 0 but still want to register with rank 1"})
        )
    );
    assert_eq!(
        server.post("/register_request", register("r9", 9)).await,
        ok
    );

    let query = json!({"req_ids": ["r1", "unknown", "r9"], "tp_rank": 1, "tp_size": 2});
    assert_eq!(
        server.post("/query_requests", query).await,
        (
            StatusCode::OK,
            json!({"results": {
                "r1": ["ok", ["tcp://p:101"]],
                "unknown": ["retry", []],
                "r9": ["Prefiller DP group 9 not found", []]
            }})
        )
    );
    assert_eq!(
        server
            .post(
                "/query_requests",
                json!({"req_ids": ["r1"], "tp_rank": 0, "tp_size": 1})
            )
            .await,
        (
            StatusCode::BAD_REQUEST,
            json!({"detail": "heterogeneous TP is not supported yet. TP size mismatch: expected 2, got 1"})
        )
    );
    // A larger D tp size may only mean P has not registered every tp rank yet: answered per id.
    let (status, body) = server
        .post(
            "/query_requests",
            json!({"req_ids": ["r1"], "tp_rank": 3, "tp_size": 4}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        body["results"]["r1"],
        json!(["Prefiller TP rank 3 not matched in DP group 0", []])
    );

    // Release after transfer: idempotent, and the id reads as unknown afterwards.
    let (status, body) = server.call(Method::DELETE, "/requests/r1", None).await;
    assert_eq!(
        (status, body),
        (StatusCode::OK, json!({"status": "ok", "released": true}))
    );
    let (_, body) = server.call(Method::DELETE, "/requests/r1", None).await;
    assert_eq!(body["released"], false);
    let (_, body) = server
        .post(
            "/query_requests",
            json!({"req_ids": ["r1"], "tp_rank": 0, "tp_size": 2}),
        )
        .await;
    assert_eq!(body["results"]["r1"], json!(["retry", []]));
}

async fn tp_rank_not_registered_is_a_per_request_error() {
    let server = start().await;
    server.register("e", 0, 0, 0, "tcp://p:1").await;
    server.register("e", 1, 0, 0, "tcp://p:2").await;
    server.register("e", 1, 1, 0, "tcp://p:3").await;
    server
        .post("/register_request", json!({"req_id": "r", "dp_rank": 0}))
        .await;
    let (_, body) = server
        .post(
            "/query_requests",
            json!({"req_ids": ["r"], "tp_rank": 1, "tp_size": 2}),
        )
        .await;
    assert_eq!(
        body["results"]["r"],
        json!(["Prefiller TP rank 1 not matched in DP group 0", []])
    );
}

async fn request_ids_expire_after_the_ttl() {
    let server =
        start_with(|c| c.registry.request_ttl = std::time::Duration::from_millis(300)).await;
    server.register("e", 0, 0, 0, "tcp://p:1").await;
    server
        .post("/register_request", json!({"req_id": "r", "dp_rank": 0}))
        .await;
    let query = json!({"req_ids": ["r"], "tp_rank": 0, "tp_size": 1});
    let (_, body) = server.post("/query_requests", query.clone()).await;
    assert_eq!(body["results"]["r"], json!(["ok", ["tcp://p:1"]]));
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    let (_, body) = server.post("/query_requests", query).await;
    assert_eq!(body["results"]["r"], json!(["retry", []]));
    let metrics = server.metrics().await;
    assert!(
        metrics.contains("bootstrap_pruned_requests_total 1"),
        "{metrics}"
    );
    assert!(metrics.contains("bootstrap_live_requests 0"), "{metrics}");
}

async fn a_full_request_map_answers_503() {
    let server = start_with(|c| c.registry.max_requests = 2).await;
    for id in ["a", "b"] {
        assert_eq!(
            server
                .post("/register_request", json!({"req_id": id, "dp_rank": 0}))
                .await
                .0,
            StatusCode::OK
        );
    }
    let (status, body) = server
        .post("/register_request", json!({"req_id": "c", "dp_rank": 0}))
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body["detail"].as_str().unwrap().contains("full"), "{body}");
    server.call(Method::DELETE, "/requests/a", None).await;
    assert_eq!(
        server
            .post("/register_request", json!({"req_id": "c", "dp_rank": 0}))
            .await
            .0,
        StatusCode::OK
    );
}

async fn health_and_metrics() {
    let server = start().await;
    assert_eq!(
        server.get("/health").await,
        (StatusCode::OK, json!({"status": "ok"}))
    );
    assert_eq!(
        server.get("/ready").await,
        (
            StatusCode::OK,
            json!({"status": "ready", "registered": 0, "missing": 0})
        )
    );
    server.register("e", 0, 0, 0, "tcp://p:1").await;
    server.register("e", 0, 0, 0, "tcp://p:2").await;
    server
        .post("/register_request", json!({"req_id": "r", "dp_rank": 0}))
        .await;
    server
        .post(
            "/query_requests",
            json!({"req_ids": ["r", "x"], "tp_rank": 0, "tp_size": 1}),
        )
        .await;
    let metrics = server.metrics().await;
    for line in [
        r#"bootstrap_http_requests_total{method="POST",route="/register",status="200"} 2"#,
        "bootstrap_engine_takeovers_total 1",
        r#"bootstrap_request_lookups_total{result="ok"} 1"#,
        r#"bootstrap_request_lookups_total{result="retry"} 1"#,
        "bootstrap_workers 1",
        "bootstrap_engines 1",
        "bootstrap_live_requests 1",
        "bootstrap_http_request_duration_seconds_bucket",
        // Two registrations one after the other: two batches of one write, two flushes.
        "bootstrap_write_batch_size_sum 2",
        "bootstrap_write_batch_size_count 2",
        "bootstrap_store_flush_duration_seconds_count 2",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
    // The dashboard under docs/ queries only metrics the server exports.
    let dashboard = include_str!("../../docs/grafana/pd-bootstrap.json");
    match pd_service::check_dashboard(dashboard, "bootstrap_", &metrics) {
        Ok(checked) => assert!(checked >= 12, "only {checked} metrics named"),
        Err(missing) => panic!("the dashboard queries {missing:?}, not exported"),
    }
}

async fn writes_need_the_token_and_reads_stay_open() {
    let server = start_with(|c| c.auth_token = Some("s3cret".into())).await;
    let body =
        json!({"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://p:1"});
    for token in [None, Some("wrong"), Some("s3cre"), Some("s3cret!")] {
        let (status, answer) = server
            .call_with(Method::POST, "/register", Some(body.clone()), token)
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "token {token:?}");
        assert!(answer["detail"].as_str().unwrap().contains("Bearer"));
    }
    let (status, _) = server
        .call_with(Method::DELETE, "/requests/x", None, None)
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _) = server
        .call_with(Method::POST, "/register", Some(body), Some("s3cret"))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(server.get("/query").await.0, StatusCode::OK);
    let (status, _) = server
        .post(
            "/query_requests",
            json!({"req_ids": [], "tp_rank": 0, "tp_size": 1}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
}

on_both_backends!("current_thread"; engine_keyed_registration_and_query, conflicts_use_vllm_wording, a_restarted_engine_takes_its_ranks_back, takeover_is_the_default_so_stock_vllm_restarts, expected_topology_gates_query_and_ranks, request_keyed_api, tp_rank_not_registered_is_a_per_request_error, request_ids_expire_after_the_ttl, a_full_request_map_answers_503, health_and_metrics, writes_need_the_token_and_reads_stay_open);
