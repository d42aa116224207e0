//! Robustness against slow clients and failing backends: stalled bodies are cut off in bounded
//! time and memory, a frozen prefill fails its request fast and is taken out, and a backend's
//! rejection reaches the client as the backend sent it.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

#[tokio::test]
async fn a_frozen_prefill_fails_fast_and_traffic_moves_away() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.prefill_timeout = Duration::from_millis(500)
    })
    .await;
    // P accepts and never answers; D waits for the KV, as a real D does.
    cluster.prefill.set(|b| b.delay = Duration::from_secs(60));
    cluster.decode().set(|b| b.delay = Duration::from_secs(60));
    let frozen = Instant::now();
    let (status, headers, text) = cluster
        .post("/v1/completions", json!({"prompt": "hi"}))
        .await;
    let to_error = frozen.elapsed();
    assert_eq!(status, 504, "{text}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["type"], "timeout");
    // The operators' header names the prefill; the body does not.
    assert!(!text.contains(&cluster.prefill.url()), "{text}");
    let upstream = headers["x-pd-upstream"].to_str().unwrap();
    assert!(upstream.contains(&cluster.prefill.url()), "{upstream}");
    assert!(to_error < Duration::from_millis(1500), "{to_error:?}");
    // The frozen P is out at once: the next request is refused without waiting for it.
    let moved = Instant::now();
    let (status, _, _) = cluster
        .post("/v1/completions", json!({"prompt": "hi"}))
        .await;
    assert_eq!(status, 503);
    assert!(
        moved.elapsed() < Duration::from_millis(200),
        "{:?}",
        moved.elapsed()
    );
    let ready = json_of(cluster.client.get(cluster.url("/ready"))).await;
    assert_eq!(ready["prefills"][0]["healthy"], false, "{ready}");
    eprintln!("freeze -> client error: {to_error:?}; -> traffic away: immediately after");
}

#[tokio::test]
async fn a_backend_body_limit_comes_back_as_its_413() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |_| {}).await;
    // The mocks, like vLLM, refuse bodies over their limit (axum's 2 MB) without reading them.
    let prompt = "x".repeat(5 << 20);
    let (status, headers, text) = cluster
        .post("/v1/completions", json!({"prompt": prompt}))
        .await;
    assert_eq!(status, 413, "{text}");
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
            || headers["content-type"] == "application/json",
        "{headers:?}"
    );
}

/// Opens a connection to the proxy and sends the head of a POST whose body never completes.
fn stalled(addr: &str, declared: usize, sent: usize) -> std::net::TcpStream {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {declared}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&vec![b' '; sent]).unwrap();
    stream
}

#[tokio::test]
async fn a_stalled_body_gets_408_within_the_deadline() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.clients.body_read_timeout = Duration::from_millis(500)
    })
    .await;
    let addr = cluster.proxy.addr().to_string();
    let answer = tokio::task::spawn_blocking(move || {
        let mut stream = stalled(&addr, 1000, 10);
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let started = Instant::now();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        (
            started.elapsed(),
            String::from_utf8_lossy(&answer).into_owned(),
        )
    })
    .await
    .unwrap();
    let (took, text) = answer;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        text.contains("application/json") && text.contains("\"timeout\""),
        "{text}"
    );
    assert!(took < Duration::from_millis(1500), "{took:?}");
    let metrics = cluster.metrics().await;
    assert!(metrics.contains(r#"outcome="client_timeout",route="/v1/completions"} 1"#));
}

/// Resident memory of `pid`, in MiB.
fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap()
        .parse()
        .unwrap();
    kib / 1024
}

#[tokio::test]
async fn a_hundred_stalled_bodies_cost_bounded_memory() {
    // The real binary, so that its memory is its own.
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    let bootstrap = Bootstrap::start(topology(&[(0, "engine-0")])).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let proxy = std::process::Command::new(env!("CARGO_BIN_EXE_pd-proxy"))
        .args([
            "--port",
            &port.to_string(),
            "--prefill",
            &prefill.url(),
            bootstrap.url().rsplit(':').next().unwrap(),
        ])
        .args(["--decode", &decode.url(), "--body-read-timeout", "30"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let proxy = KillOnDrop(proxy);
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(Instant::now() < deadline, "the proxy did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = rss_mib(proxy.0.id());
    // 100 clients each declare 50 MiB and send 4 MiB of it, then stall.
    let streams = tokio::task::spawn_blocking(move || {
        (0..100)
            .map(|_| {
                let mut stream = std::net::TcpStream::connect(&addr).unwrap();
                let head = format!(
                    "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
                    50 << 20
                );
                stream.write_all(head.as_bytes()).unwrap();
                stream.set_nonblocking(true).unwrap();
                let chunk = vec![b' '; 64 << 10];
                let mut sent = 0;
                while sent < 4 << 20 {
                    match stream.write(&chunk) {
                        Ok(n) => sent += n,
                        // The proxy stopped reading: the rest waits in the socket.
                        Err(_) => break,
                    }
                }
                stream
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = rss_mib(proxy.0.id());
    eprintln!("proxy RSS: {before} MiB before, {after} MiB with 100 stalled bodies");
    assert!(after < 100, "{after} MiB");
    drop(streams);
}

/// A child process killed when the test ends, also when it fails.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_api_key_scheme_is_case_insensitive_and_errors_have_a_stable_shape() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.api_key = Some("s3cret".into())
    })
    .await;
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let answer = cluster
            .client
            .post(cluster.url("/v1/completions"))
            .header("authorization", format!("{scheme} s3cret"))
            .json(&json!({"prompt": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200, "{scheme}");
    }
    let refused = cluster
        .client
        .post(cluster.url("/v1/completions"))
        .header("authorization", "Bearer wrong")
        .json(&json!({"prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    let error: Value = refused.json().await.unwrap();
    assert_eq!(error["error"]["type"], "authentication_error");
    assert_eq!(error["error"]["code"], "invalid_api_key");
    assert!(error["error"]["message"].is_string());
}

/// `--header-read-timeout`, `--max-connections` and the JSON of hyper's own refusals reach the
/// server: headers that never end are cut at the limit, a connection past the cap waits until
/// one closes, and a malformed request line gets a 400 in OpenAI's shape.
#[tokio::test]
async fn the_client_limits_hold_on_the_serving_port() {
    let cluster = Cluster::start(1, &[(0, "engine-0")], |config| {
        config.clients.header_read_timeout = Duration::from_millis(500);
        config.clients.max_connections = 2;
    })
    .await;
    let addr = cluster.proxy.addr().to_string();
    let (took, malformed) = tokio::task::spawn_blocking(move || {
        let read_all = |mut stream: std::net::TcpStream| {
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let mut answer = Vec::new();
            let _ = stream.read_to_end(&mut answer);
            String::from_utf8_lossy(&answer).into_owned()
        };
        let mut slow = std::net::TcpStream::connect(&addr).unwrap();
        slow.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            .unwrap();
        let started = Instant::now();
        read_all(slow);
        let took = started.elapsed();
        let mut broken = std::net::TcpStream::connect(&addr).unwrap();
        broken.write_all(b"NOT HTTP AT ALL\r\n\r\n").unwrap();
        (took, read_all(broken))
    })
    .await
    .unwrap();
    assert!(
        took < Duration::from_millis(1500),
        "headers cut after {took:?}"
    );
    assert!(malformed.starts_with("HTTP/1.1 400"), "{malformed}");
    assert!(malformed.contains("invalid_request_error"), "{malformed}");
    // Two idle connections hold both slots; a third waits until one of them closes.
    let idle: Vec<std::net::TcpStream> = (0..2)
        .map(|_| std::net::TcpStream::connect(cluster.proxy.addr()).unwrap())
        .collect();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let waiting = cluster.client.get(cluster.url("/health")).send();
    let first = tokio::time::timeout(Duration::from_millis(300), waiting).await;
    assert!(
        first.is_err(),
        "a third connection was served past the cap of two"
    );
    drop(idle);
    let served = cluster
        .client
        .get(cluster.url("/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(served.status(), 200);
}
