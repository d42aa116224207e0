//! The real binary's shutdown on SIGTERM with `--shutdown-delay`: not ready at once while
//! everything else is served, then closed to new connections while the requests in flight
//! finish (long polls answer at once), then exit 0.

mod common;

use std::ffi::OsStr;
use std::time::{Duration, Instant};

use common::binary::start_binary;
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::process::Child;

fn signal(server: &Child, signal: libc::c_int) {
    let pid = i32::try_from(server.id().unwrap()).unwrap();
    // SAFETY: kill(2) with a valid pid and signal number has no memory effects.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
}

async fn get(url: &str) -> (StatusCode, Value) {
    let answer = reqwest::get(url).await.unwrap();
    (answer.status(), answer.json().await.unwrap())
}

async fn register(url: &str, tp: u32) -> reqwest::Response {
    let body = json!({"engine_id": "e", "dp_rank": 0, "tp_rank": tp, "pp_rank": 0,
                      "addr": format!("tcp://p:{}", 100 + tp)});
    (reqwest::Client::new()
        .post(format!("{url}/register"))
        .json(&body))
    .send()
    .await
    .unwrap()
}

/// Waits until `{url}/readyz` answers 503; returns how long that took.
async fn until_not_ready(url: &str) -> Duration {
    let started = Instant::now();
    while get(&format!("{url}/readyz")).await.0 != StatusCode::SERVICE_UNAVAILABLE {
        assert!(started.elapsed() < Duration::from_secs(5), "still ready");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    started.elapsed()
}

#[tokio::test]
async fn sigterm_turns_readiness_off_for_the_delay_then_finishes_requests_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let delay = Duration::from_millis(1500);
    let flags = ["--shutdown-delay", "1.5", "--shutdown-grace", "10"].map(OsStr::new);
    let (server, url) = start_binary(
        &[
            &[OsStr::new("--data-dir"), dir.path().as_os_str()],
            &flags[..],
        ]
        .concat(),
    )
    .await;
    assert_eq!(
        get(&format!("{url}/readyz")).await,
        (StatusCode::OK, json!({"status": "ready"}))
    );
    let addr = url.trim_start_matches("http://").to_owned();
    // A registration in flight: its headers are in, its body comes after the delay.
    let body = json!({"engine_id": "e", "dp_rank": 0, "tp_rank": 7, "pp_rank": 0,
                      "addr": "tcp://p:107"})
    .to_string();
    let (head, tail) = body.split_at(body.len() / 2);
    let mut slow = TcpStream::connect(&addr).await.unwrap();
    let request = format!(
        "POST /register HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{head}",
        body.len()
    );
    slow.write_all(request.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    let signalled = Instant::now();
    signal(&server, libc::SIGTERM);
    let took = until_not_ready(&url).await;
    assert!(
        took < Duration::from_millis(250),
        "not ready after {took:?}"
    );
    let (status, ready) = get(&format!("{url}/ready")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        (&ready["status"], &ready["detail"]),
        (&json!("not_ready"), &json!("shutting down"))
    );
    assert_eq!(
        get(&format!("{url}/readyz")).await.1,
        json!({"status": "not_ready", "detail": "shutting down"})
    );
    // Everything else is served as usual, each answer closing its connection.
    assert_eq!(get(&format!("{url}/health")).await.0, StatusCode::OK);
    let registered = register(&url, 0).await;
    assert_eq!(registered.status(), StatusCode::OK);
    assert_eq!(registered.headers()["connection"], "close");
    let (status, workers) = get(&format!("{url}/workers")).await;
    assert_eq!(status, StatusCode::OK);
    // A long poll begun during the delay answers when the server stops accepting.
    let revision = workers["revision"].as_u64().unwrap();
    let watch_url = format!("{url}/watch?since={revision}&timeout_ms=20000");
    let watch = tokio::spawn(async move { get(&watch_url).await });
    assert!(
        signalled.elapsed() < delay,
        "the checks outlasted the delay"
    );

    // After the delay: new connections are refused.
    while TcpStream::connect(&addr).await.is_ok() {
        assert!(signalled.elapsed() < delay * 2, "still accepting");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let closed = signalled.elapsed();
    assert!(closed >= delay - Duration::from_millis(50), "{closed:?}");
    let (status, batch) = tokio::time::timeout(Duration::from_secs(2), watch)
        .await
        .expect("the long poll ends at the stop, not after its 20 s")
        .unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(batch["events"], json!([]));
    // The registration in flight finishes.
    slow.write_all(tail.as_bytes()).await.unwrap();
    let mut answer = String::new();
    slow.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    let status = tokio::time::timeout(Duration::from_secs(10), wait(server))
        .await
        .expect("the server exits within the grace");
    assert!(status.success(), "{status}");
    // Both registrations were made durable.
    let (_server, url) = start_binary(&[dir.path().as_os_str()]).await;
    // The table (`/workers`): tp ranks 0 and 7 are no whole engine for `/query` to show.
    let (_, listed) = get(&format!("{url}/workers")).await;
    let ranks: Vec<&Value> = listed["workers"].as_array().unwrap().iter().collect();
    assert_eq!(ranks.len(), 2, "tp ranks 0 and 7: {listed}");
}

#[tokio::test]
async fn a_second_signal_skips_the_rest_of_the_delay() {
    let dir = tempfile::tempdir().unwrap();
    let flags = [OsStr::new("--data-dir"), dir.path().as_os_str()];
    let (server, url) = start_binary(
        &[
            &flags[..],
            &[OsStr::new("--shutdown-delay"), OsStr::new("60")],
        ]
        .concat(),
    )
    .await;
    signal(&server, libc::SIGTERM);
    until_not_ready(&url).await;
    assert_eq!(register(&url, 0).await.status(), StatusCode::OK);
    let second = Instant::now();
    signal(&server, libc::SIGINT);
    let status = tokio::time::timeout(Duration::from_secs(5), wait(server))
        .await
        .expect("the second signal stops the server");
    assert!(status.success(), "{status}");
    assert!(second.elapsed() < Duration::from_secs(5));
}

async fn wait(mut child: Child) -> std::process::ExitStatus {
    child.wait().await.unwrap()
}
