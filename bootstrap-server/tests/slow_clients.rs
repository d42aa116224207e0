//! A client that stalls mid-request holds its connection for `--request-timeout` at most: a
//! stalled body is answered with a JSON 408, stalled headers get the connection closed, and the
//! server keeps answering everyone else meanwhile.

mod common;

use std::ffi::OsStr;
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The bound the stalled-body test starts the server with.
const TIMEOUT: Duration = Duration::from_millis(600);

/// The real binary with `--request-timeout` at `timeout`, and its host:port.
async fn start(timeout: Duration) -> (tokio::process::Child, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let seconds = timeout.as_secs_f64().to_string();
    let (child, url) = common::binary::start_binary(&[
        OsStr::new("--data-dir"),
        dir.path().as_os_str(),
        OsStr::new("--request-timeout"),
        OsStr::new(&seconds),
    ])
    .await;
    let addr = url.trim_start_matches("http://").to_owned();
    (child, addr, dir)
}

/// Writes `head` and then nothing more; returns what the server sent until it closed the
/// connection, and how long that took.
async fn stall_after(addr: &str, head: &str) -> (String, Duration) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .expect("the server ends a stalled request within 10 s")
        .unwrap();
    (
        String::from_utf8_lossy(&answer).into_owned(),
        started.elapsed(),
    )
}

/// A stalled request ended when the timeout ran out: not before, and not long after.
fn assert_ended_at_the_timeout(took: Duration, timeout: Duration) {
    assert!(
        took >= timeout - Duration::from_millis(100) && took < timeout * 5,
        "ended after {took:?}, the timeout is {timeout:?}"
    );
}

#[tokio::test]
async fn a_stalled_body_gets_a_json_408_after_the_request_timeout() {
    let (_server, addr, _dir) = start(TIMEOUT).await;
    let head = format!(
        "POST /register HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         content-length: 200\r\n\r\n{{\"engine_id\": \"e\""
    );
    let (answer, took) = stall_after(&addr, &head).await;
    assert!(
        answer.starts_with("HTTP/1.1 408"),
        "a stalled body is a 408: {answer}"
    );
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    let error: Value = serde_json::from_str(body).expect("the 408's body is JSON");
    assert!(error["detail"].is_string(), "{error}");
    assert_ended_at_the_timeout(took, TIMEOUT);
}

#[tokio::test]
async fn stalled_headers_get_the_connection_closed_and_others_are_served_meanwhile() {
    // Long enough that another client's request fits in it on a loaded machine.
    let timeout = Duration::from_secs(2);
    let (_server, addr, _dir) = start(timeout).await;
    let stalled = tokio::spawn({
        let addr = addr.clone();
        async move { stall_after(&addr, "GET /query HTTP/1.1\r\nhost: x\r\nx-slow: ").await }
    });
    // While that connection waits, the server answers another client.
    tokio::time::sleep(timeout / 3).await;
    let health = reqwest::get(format!("http://{addr}/health")).await.unwrap();
    assert!(health.status().is_success());
    assert!(
        !stalled.is_finished(),
        "the stalled connection outlived the other client's request"
    );

    let (answer, took) = stalled.await.unwrap();
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "stalled headers end the connection: {answer}"
    );
    assert_ended_at_the_timeout(took, timeout);
}

#[tokio::test]
async fn a_watch_long_poll_ends_inside_a_short_request_timeout() {
    // Long enough that a loaded machine cannot blur five sixths of it with the whole of it.
    let timeout = Duration::from_secs(3);
    let (_server, addr, _dir) = start(timeout).await;
    let listed = common::binary::get_json(&format!("http://{addr}/workers")).await;
    let revision = listed["revision"].as_u64().unwrap();
    let started = Instant::now();
    let polled = reqwest::get(format!(
        "http://{addr}/watch?since={revision}&timeout_ms=20000"
    ))
    .await
    .unwrap();
    let took = started.elapsed();
    assert_eq!(polled.status(), 200, "an empty batch, not a 408");
    let batch: Value = polled.json().await.unwrap();
    assert_eq!(batch["events"], serde_json::json!([]), "{batch}");
    assert!(
        took >= timeout / 2 && took < timeout,
        "the long poll ended after {took:?}"
    );
}
