//! Leases and the watch, on both backends: a leased worker lives by its keepalives, an expired or
//! revoked lease removes it, and `GET /watch` reports every change in order.

mod common;

use std::time::{Duration, Instant};

use common::{start, TestServer};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

async fn register_leased(server: &TestServer, dp: u32, ttl: u32) -> (i64, u64) {
    let (status, body) = server
        .post(
            "/register",
            json!({"engine_id": "e1", "dp_rank": dp, "tp_rank": 0, "pp_rank": 0,
                   "addr": format!("tcp://p:{}", 5000 + dp), "lease_ttl": ttl}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "ok");
    let granted = body["lease_ttl"].as_u64().unwrap();
    assert!(granted >= u64::from(ttl), "{body}");
    (body["lease_id"].as_i64().unwrap(), granted)
}

async fn registered_ranks(server: &TestServer) -> Vec<u64> {
    let (status, list) = server.get("/workers").await;
    assert_eq!(status, 200);
    list["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["dp_rank"].as_u64().unwrap())
        .collect()
}

async fn revision(server: &TestServer) -> u64 {
    server.get("/workers").await.1["revision"].as_u64().unwrap()
}

async fn watch(server: &TestServer, since: u64, timeout_ms: u64) -> (StatusCode, Value) {
    server
        .get(&format!("/watch?since={since}&timeout_ms={timeout_ms}"))
        .await
}

/// Waits for the next batch of events after `since`, following empty batches.
async fn next_events(server: &TestServer, since: u64) -> (u64, Vec<Value>) {
    let mut since = since;
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        let (status, batch) = watch(server, since, 2_000).await;
        assert_eq!(status, 200, "{batch}");
        let events = batch["events"].as_array().unwrap().clone();
        since = batch["revision"].as_u64().unwrap();
        if !events.is_empty() {
            return (since, events);
        }
    }
    panic!("no change reported within 15 s");
}

async fn leased_workers_live_by_keepalives_and_expire_without_them() {
    let server = start().await;
    server
        .register("e1", 0, 0, 0, "tcp://p:4999")
        .await
        .0
        .is_success()
        .then_some(())
        .unwrap();
    let (lease, ttl) = register_leased(&server, 1, 1).await;
    let since = revision(&server).await;

    // Kept alive over several ttls, the worker stays.
    let kept_until = Instant::now() + Duration::from_secs(ttl * 2 + 1);
    while Instant::now() < kept_until {
        let (status, body) = server
            .post(&format!("/leases/{lease}/keepalive"), json!({}))
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["lease_id"], lease);
        assert_eq!(body["lease_ttl"], ttl);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(registered_ranks(&server).await, vec![0, 1]);

    // Left alone, it expires; the watch says so; the worker without a lease stays.
    let stopped = Instant::now();
    let (_, events) = next_events(&server, since).await;
    let expired_after = stopped.elapsed();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["type"], "delete");
    assert_eq!(events[0]["worker"]["dp_rank"], 1);
    assert_eq!(events[0]["worker"]["addr"], "tcp://p:5001");
    assert_eq!(events[0]["worker"]["lease_id"], lease);
    assert!(
        expired_after < Duration::from_secs(ttl + 3),
        "expired after {expired_after:?}"
    );
    assert_eq!(registered_ranks(&server).await, vec![0]);
    let metrics = server.metrics().await;
    assert!(
        metrics.contains("\nbootstrap_lease_removed_workers_total 1\n"),
        "{metrics}"
    );
    let (status, body) = server
        .post(&format!("/leases/{lease}/keepalive"), json!({}))
        .await;
    assert_eq!(status, 404);
    assert!(body["detail"].as_str().unwrap().contains("register again"));
}

async fn a_revoked_lease_removes_its_workers_at_once() {
    let server = start().await;
    let (lease, _) = register_leased(&server, 0, 30).await;
    let (other, _) = register_leased(&server, 1, 30).await;
    let (status, body) = server
        .call(Method::DELETE, &format!("/leases/{lease}"), None)
        .await;
    assert_eq!((status, &body["revoked"]), (StatusCode::OK, &json!(true)));
    // Gone from this server's view by the time the answer arrives, and counted.
    assert_eq!(registered_ranks(&server).await, vec![1]);
    let metrics = server.metrics().await;
    assert!(
        metrics.contains("\nbootstrap_lease_removed_workers_total 1\n"),
        "{metrics}"
    );
    let (status, body) = server
        .call(Method::DELETE, &format!("/leases/{lease}"), None)
        .await;
    assert_eq!((status, &body["revoked"]), (StatusCode::OK, &json!(false)));
    let (status, _) = server
        .post(&format!("/leases/{other}/keepalive"), json!({}))
        .await;
    assert_eq!(status, 200);
}

async fn registering_again_moves_a_slot_to_a_new_lease_or_none() {
    let server = start().await;
    let (first, _) = register_leased(&server, 0, 30).await;
    let (second, _) = register_leased(&server, 0, 30).await;
    assert_ne!(first, second);
    let (_, list) = server.get("/workers").await;
    assert_eq!(list["workers"][0]["lease_id"], second);
    // The lease the slot moved away from holds nothing any more: it is revoked.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (status, _) = server
            .post(&format!("/leases/{first}/keepalive"), json!({}))
            .await;
        if status == 404 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the superseded lease is still live"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(registered_ranks(&server).await, vec![0]);
    // A registration without a lease makes it permanent.
    assert_eq!(server.register("e1", 0, 0, 0, "tcp://p:5000").await.0, 200);
    server
        .call(Method::DELETE, &format!("/leases/{second}"), None)
        .await;
    let (_, list) = server.get("/workers").await;
    assert_eq!(list["workers"][0]["addr"], "tcp://p:5000");
    assert!(list["workers"][0].get("lease_id").is_none());
}

async fn bad_lease_input_is_refused_by_field() {
    let server = start().await;
    for ttl in [json!(0), json!(86_401), json!(-1), json!("10")] {
        let (status, body) = server
            .post(
                "/register",
                json!({"engine_id": "e1", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0,
                       "addr": "tcp://p:1", "lease_ttl": ttl}),
            )
            .await;
        assert_eq!(status, 422, "{ttl}: {body}");
        assert!(
            body["detail"].as_str().unwrap().contains("lease_ttl"),
            "{body}"
        );
    }
    let (status, body) = server.post("/leases/abc/keepalive", json!({})).await;
    assert_eq!(status, 400, "{body}");
    let (status, _) = server.post("/leases/12345/keepalive", json!({})).await;
    assert_eq!(status, 404);
    for query in [
        "/watch",
        "/watch?since=x",
        "/watch?since=-1",
        "/watch?since=1&timeout_ms=z",
    ] {
        let (status, body) = server.get(query).await;
        assert_eq!(status, 400, "{query}: {body}");
        assert!(body["detail"].as_str().is_some());
    }
    assert!(registered_ranks(&server).await.is_empty());
}

async fn the_watch_reports_changes_in_order_and_waits_for_them() {
    let server = start().await;
    let since = revision(&server).await;

    // Nothing happens: the wait runs out with no events.
    let started = Instant::now();
    let (status, batch) = watch(&server, since, 300).await;
    assert_eq!(status, 200);
    assert_eq!(batch["events"], json!([]));
    assert!(started.elapsed() >= Duration::from_millis(250));
    assert!(batch["revision"].as_u64().unwrap() >= since);

    // A watch already waiting hears about a registration at once.
    let waiting = async {
        let started = Instant::now();
        let (since, events) = next_events(&server, since).await;
        (since, events, started.elapsed())
    };
    let registering = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(server.register("e1", 0, 0, 0, "tcp://p:1").await.0, 200);
        assert_eq!(server.register("e1", 0, 1, 0, "tcp://p:2").await.0, 200);
    };
    let ((next, events, waited), ()) = tokio::join!(waiting, registering);
    assert!(waited < Duration::from_secs(2), "waited {waited:?}");
    assert_eq!(events[0]["type"], "put");
    assert_eq!(events[0]["worker"]["engine_id"], "e1");
    assert_eq!(events[0]["worker"]["addr"], "tcp://p:1");
    let mut events = events;
    if events.len() == 1 {
        events.extend(next_events(&server, next).await.1);
    }
    assert_eq!(events[1]["worker"]["tp_rank"], 1);
    assert!(events[0]["revision"].as_u64() < events[1]["revision"].as_u64());

    // A deregistration is a delete of what was registered.
    let after_puts = revision(&server).await;
    let (status, _) = server
        .deregister(json!({"engine_id": "e1", "tp_rank": 1}))
        .await;
    assert_eq!(status, 200);
    let (_, events) = next_events(&server, after_puts).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["type"], "delete");
    assert_eq!(events[0]["worker"]["addr"], "tcp://p:2");

    // The same history from the start, all at once.
    let (_, batch) = watch(&server, since, 0).await;
    let kinds: Vec<&str> = batch["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["put", "put", "delete"]);
}

async fn a_watch_from_before_the_kept_history_is_told_to_relist() {
    let server = start().await;
    assert_eq!(server.register("e1", 0, 0, 0, "tcp://p:1").await.0, 200);
    let before = revision(&server).await - 1;
    // A restarted server (sled) or another replica (etcd) keeps history from its own start.
    let server = server.successor().await;
    let (status, body) = watch(&server, before, 0).await;
    assert_eq!(status, 410, "{body}");
    assert!(body["detail"].as_str().unwrap().contains("re-list"));
    let current = body["revision"].as_u64().unwrap();
    let (_, list) = server.get("/workers").await;
    // With etcd the revision also moves with other writes to etcd (other clusters, progress).
    assert!(list["revision"].as_u64().unwrap() >= current, "{list}");
    assert_eq!(list["workers"][0]["addr"], "tcp://p:1");
    let (status, batch) = watch(&server, current, 0).await;
    assert_eq!(
        (status, batch["events"].clone()),
        (StatusCode::OK, json!([]))
    );
}

/// `value` as JavaScript's `JSON.parse` reads it: every number a double.
fn read_as_doubles(value: &Value) -> Value {
    match value {
        Value::Number(n) => json!(n.as_f64().unwrap()),
        Value::Array(items) => Value::Array(items.iter().map(read_as_doubles).collect()),
        Value::Object(fields) => Value::Object(
            (fields.iter())
                .map(|(k, v)| (k.clone(), read_as_doubles(v)))
                .collect(),
        ),
        other => other.clone(),
    }
}

async fn lease_ids_are_exact_for_parsers_that_read_numbers_as_doubles() {
    let server = start().await;
    let since = revision(&server).await;
    let (status, registered) = server
        .post(
            "/register",
            json!({"engine_id": "e1", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0,
                   "addr": "tcp://p:5000", "lease_ttl": 30}),
        )
        .await;
    assert_eq!(status, 200, "{registered}");
    let lease = registered["lease_id"].as_i64().unwrap();
    let (_, kept) = server
        .post(&format!("/leases/{lease}/keepalive"), json!({}))
        .await;
    let (_, listed) = server.get("/workers").await;
    let (_, events) = next_events(&server, since).await;
    let answers = [
        read_as_doubles(&registered),
        read_as_doubles(&kept),
        read_as_doubles(&listed["workers"][0]),
        read_as_doubles(&events[0]["worker"]),
    ];
    for answer in &answers {
        // The string is exact whatever the parser does with numbers ...
        assert_eq!(answer["lease_id_str"], lease.to_string(), "{answer}");
        // ... where the number is not, for ids a double cannot hold (sled draws 63 bits,
        // etcd counts from a 63-bit start; about one id in a thousand has enough low zero
        // bits to survive the trip).
        if (lease as f64) as i64 != lease {
            assert_ne!(answer["lease_id"].as_f64().unwrap() as i64, lease);
        }
    }
}

on_both_backends!("multi_thread";
    leased_workers_live_by_keepalives_and_expire_without_them,
    a_revoked_lease_removes_its_workers_at_once,
    registering_again_moves_a_slot_to_a_new_lease_or_none,
    bad_lease_input_is_refused_by_field,
    the_watch_reports_changes_in_order_and_waits_for_them,
    a_watch_from_before_the_kept_history_is_told_to_relist,
    lease_ids_are_exact_for_parsers_that_read_numbers_as_doubles,
);
