//! The real binary: what got a 200 survives `kill -9`; request ids survive a graceful restart.

mod common;

use std::time::Duration;

use common::binary::{get_json, start_binary};
use serde_json::{json, Value};
use tokio::process::Child;

async fn post(url: &str, body: Value) -> reqwest::StatusCode {
    reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap()
        .status()
}

#[tokio::test]
async fn registrations_survive_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, url) = start_binary(&[dir.path().as_os_str()]).await;
    for tp in 0..4 {
        let body = json!({"engine_id": "e", "dp_rank": 0, "tp_rank": tp, "pp_rank": 0, "addr": format!("tcp://p:{}", 100 + tp)});
        assert_eq!(post(&format!("{url}/register"), body).await, 200);
    }
    let before = get_json(&format!("{url}/query")).await;
    server.start_kill().unwrap(); // SIGKILL: no flush, no shutdown
    server.wait().await.unwrap();

    let (_server, url) = start_binary(&[dir.path().as_os_str()]).await;
    assert_eq!(get_json(&format!("{url}/query")).await, before);
    assert_eq!(before["0"]["worker_addr"].as_object().unwrap().len(), 4);
}

#[tokio::test]
async fn request_ids_survive_a_graceful_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (server, url) = start_binary(&[dir.path().as_os_str()]).await;
    let body =
        json!({"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://p:1"});
    assert_eq!(post(&format!("{url}/register"), body).await, 200);
    for i in 0..100 {
        let body = json!({"req_id": format!("r{i}"), "dp_rank": 0});
        assert_eq!(post(&format!("{url}/register_request"), body).await, 200);
    }
    // SIGTERM: graceful shutdown flushes the store.
    let pid = server.id().unwrap() as i32;
    // SAFETY: kill(2) with a valid pid and signal number has no memory effects.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = tokio::time::timeout(Duration::from_secs(10), wait_owned(server))
        .await
        .expect("the server stops within 10 s of SIGTERM");
    assert!(status.success(), "graceful shutdown exits 0, got {status}");

    let (_server, url) = start_binary(&[dir.path().as_os_str()]).await;
    let ids: Vec<String> = (0..100).map(|i| format!("r{i}")).collect();
    let answer: Value = reqwest::Client::new()
        .post(format!("{url}/query_requests"))
        .json(&json!({"req_ids": ids, "tp_rank": 0, "tp_size": 1}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for id in ids {
        assert_eq!(answer["results"][&id], json!(["ok", ["tcp://p:1"]]), "{id}");
    }
}

async fn wait_owned(mut child: Child) -> std::process::ExitStatus {
    child.wait().await.unwrap()
}
