//! Draining an engine: the mark on every worker, kept through renewals, restarts and the
//! store, shown in `GET /workers` and the watch, lifted again; behind the write auth.

mod common;

use common::*;
use reqwest::Method;
use serde_json::{json, Value};

fn draining(workers: &Value, engine: &str) -> Vec<bool> {
    workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["engine_id"] == engine)
        .map(|w| w["draining"].as_bool().unwrap_or(false))
        .collect()
}

async fn drain_marks_every_worker_and_survives_renewal_and_the_store() {
    let server = start().await;
    for tp in 0..2 {
        assert_eq!(
            server
                .register("p0", 0, tp, 0, &format!("tcp://h:{}", 7000 + tp))
                .await
                .0,
            200
        );
    }
    server.register("p1", 1, 0, 0, "tcp://h:9").await;
    let (_, listed) = server.get("/workers").await;
    let since = listed["revision"].as_u64().unwrap();

    let (status, answer) = server.call(Method::POST, "/engines/p0/drain", None).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer,
        json!({"status": "ok", "engine_id": "p0", "draining": true, "workers": 2})
    );
    let (_, workers) = server.get("/workers").await;
    assert_eq!(draining(&workers, "p0"), [true, true]);
    assert_eq!(draining(&workers, "p1"), [false]);
    // The watch reports the mark as puts of the engine's workers.
    let (_, batch) = server
        .get(&format!("/watch?since={since}&timeout_ms=1000"))
        .await;
    let events = batch["events"].as_array().unwrap();
    assert_eq!(events.len(), 2, "{batch}");
    assert!(events
        .iter()
        .all(|e| e["type"] == "put" && e["worker"]["draining"] == true));
    // Marking again changes nothing; the engine's workers keep it when they register again.
    assert_eq!(
        server.call(Method::POST, "/engines/p0/drain", None).await.0,
        200
    );
    assert_eq!(server.register("p0", 0, 1, 0, "tcp://h:7001").await.0, 200);
    assert_eq!(server.register("p0", 0, 1, 0, "tcp://h:77").await.0, 200); // restart, pinned id
    let (_, workers) = server.get("/workers").await;
    assert!(draining(&workers, "p0").iter().all(|d| *d), "{workers}");

    // Durable: the next server on the same store sees it.
    let server = server.successor().await;
    let (_, workers) = server.get("/workers").await;
    assert!(draining(&workers, "p0").iter().all(|d| *d), "{workers}");

    let (status, answer) = server.call(Method::DELETE, "/engines/p0/drain", None).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["draining"], false);
    let (_, workers) = server.get("/workers").await;
    assert!(draining(&workers, "p0").iter().all(|d| !*d), "{workers}");
    // Not shown at all while not draining.
    assert!(workers["workers"][0].get("draining").is_none(), "{workers}");
}

async fn an_unknown_engine_is_a_404_in_json() {
    let server = start().await;
    let (status, answer) = server
        .call(Method::POST, "/engines/nobody/drain", None)
        .await;
    assert_eq!(status, 404);
    assert!(
        answer["detail"].as_str().unwrap().contains("nobody"),
        "{answer}"
    );
}

on_both_backends!("multi_thread"; drain_marks_every_worker_and_survives_renewal_and_the_store, an_unknown_engine_is_a_404_in_json);

#[tokio::test]
async fn draining_is_a_write_behind_the_token() {
    let server = start_with(|config| config.auth_token = Some("s3cret".into())).await;
    let register =
        json!({"engine_id": "p0", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"});
    let (status, _) = server
        .call_with(Method::POST, "/register", Some(register), Some("s3cret"))
        .await;
    assert_eq!(status, 200);
    let (status, _) = server.call(Method::POST, "/engines/p0/drain", None).await;
    assert_eq!(status, 401);
    let (status, _) = server
        .call_with(Method::POST, "/engines/p0/drain", None, Some("s3cret"))
        .await;
    assert_eq!(status, 200);
}
