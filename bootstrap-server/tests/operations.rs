//! Operating stock vLLM over time, against the real binary with its default flags: P restarts
//! (new and pinned engine ids), incarnations in the native API and the watch, registrations
//! without an engine id beside vLLM engines, the write allow-list, and JSON for every error,
//! also those hyper answers before any route sees the request.

mod common;

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::time::Duration;

use common::binary::{get_json, start_binary};
use serde_json::{json, Value};

/// A running binary and a client for it.
struct Binary {
    _child: tokio::process::Child,
    _dir: tempfile::TempDir,
    url: String,
    http: reqwest::Client,
}

async fn binary(flags: &[&str]) -> Binary {
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<&OsStr> = vec![OsStr::new("--data-dir"), dir.path().as_os_str()];
    args.extend(flags.iter().map(OsStr::new));
    let (child, url) = start_binary(&args).await;
    Binary {
        _child: child,
        _dir: dir,
        url,
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap(),
    }
}

impl Binary {
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        auth: Option<&str>,
    ) -> (u16, String, Value) {
        let mut request = self.http.request(method, format!("{}{path}", self.url));
        if let Some(body) = body {
            request = request.json(&body);
        }
        if let Some(auth) = auth {
            request = request.header("authorization", auth);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let text = response.text().await.unwrap();
        (
            status,
            content_type,
            serde_json::from_str(&text).unwrap_or(Value::Null),
        )
    }

    /// vLLM's `POST /register` body, without any field of ours.
    async fn register(&self, engine: &str, dp: u32, tp: u32, addr: &str) -> (u16, Value) {
        let body =
            json!({"engine_id": engine, "dp_rank": dp, "tp_rank": tp, "pp_rank": 0, "addr": addr});
        let (status, _, answer) = self
            .send(reqwest::Method::POST, "/register", Some(body), None)
            .await;
        (status, answer)
    }

    async fn get(&self, path: &str) -> Value {
        get_json(&format!("{}{path}", self.url)).await
    }

    /// Sends raw bytes and returns the whole answer (the server closes after an error).
    fn raw(&self, request: &[u8]) -> String {
        let addr = self.url.trim_start_matches("http://");
        let mut stream = std::net::TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        stream.write_all(request).unwrap();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    }
}

/// Parses `GET /query` the way vLLM's D does: every entry's `engine_id` and `worker_addr`.
fn parse_like_vllm_d(topology: &Value) -> Vec<(String, String, Vec<String>)> {
    topology
        .as_object()
        .expect("an object of dp ranks")
        .iter()
        .map(|(dp, entry)| {
            let engine = entry["engine_id"]
                .as_str()
                .expect("vLLM's D reads entry[\"engine_id\"]");
            let addrs = entry["worker_addr"]
                .as_object()
                .expect("vLLM's D reads entry[\"worker_addr\"]")
                .values()
                .flat_map(|pps| pps.as_object().unwrap().values())
                .map(|addr| addr.as_str().unwrap().to_owned())
                .collect();
            (dp.clone(), engine.to_owned(), addrs)
        })
        .collect()
}

#[tokio::test]
async fn stock_p_restarts_take_over_under_the_default_flags() {
    let server = binary(&[]).await;
    assert_eq!(server.register("a", 0, 0, "tcp://10.0.0.5:1").await.0, 200);
    assert_eq!(server.register("a", 0, 1, "tcp://10.0.0.5:2").await.0, 200);
    let first = server.get("/workers").await;
    let old_incarnation = first["workers"][0]["incarnation"].as_u64().unwrap();

    // Restart with a new engine id (vLLM's default): every rank re-registers, each answer 200.
    let since = first["revision"].as_u64().unwrap();
    assert_eq!(server.register("b", 0, 0, "tcp://10.0.0.5:11").await.0, 200);
    let topology = server.get("/query").await;
    assert_eq!(
        parse_like_vllm_d(&topology),
        vec![("0".into(), "b".into(), vec!["tcp://10.0.0.5:11".into()])],
        "the old engine's other rank left with it: never half of each"
    );
    let watch = server
        .get(&format!("/watch?since={since}&timeout_ms=1000"))
        .await;
    let events = watch["events"].as_array().unwrap();
    let kinds: Vec<(&str, &str)> = events
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap(),
                e["worker"]["engine_id"].as_str().unwrap(),
            )
        })
        .collect();
    // One revision: the old engine's other worker deleted, the slot itself overwritten.
    assert_eq!(kinds, vec![("delete", "a"), ("put", "b")]);
    assert_eq!(events[0]["revision"], events[1]["revision"]);
    let new_incarnation = events[1]["worker"]["incarnation"].as_u64().unwrap();
    assert!(new_incarnation > old_incarnation);
    assert_eq!(server.register("b", 0, 1, "tcp://10.0.0.5:12").await.0, 200);

    // Restart with the engine id pinned in the config: new addresses, a new incarnation.
    assert_eq!(server.register("b", 0, 0, "tcp://10.0.0.5:21").await.0, 200);
    assert_eq!(server.register("b", 0, 1, "tcp://10.0.0.5:22").await.0, 200);
    let workers = server.get("/workers").await;
    let rows: Vec<(&str, u64)> = workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["addr"].as_str().unwrap(),
                w["incarnation"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(rows.len(), 2);
    assert!(
        rows.iter()
            .all(|(_, inc)| *inc == rows[0].1 && *inc > new_incarnation),
        "{rows:?}"
    );
    assert!(rows
        .iter()
        .all(|(addr, _)| addr.ends_with(":21") || addr.ends_with(":22")));

    let metrics = reqwest::get(format!("{}/metrics", server.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("bootstrap_engine_takeovers_total 2"),
        "{metrics}"
    );
}

#[tokio::test]
async fn the_reject_policy_stays_available() {
    let server = binary(&["--engine-conflict", "reject"]).await;
    server.register("a", 0, 0, "tcp://h:1").await;
    let (status, body) = server.register("b", 0, 0, "tcp://h:2").await;
    assert_eq!(status, 400);
    assert_eq!(
        body["detail"],
        "Engine ID mismatch for dp_rank=0: expected a, got b"
    );
}

#[tokio::test]
async fn workers_without_an_engine_id_never_break_a_vllm_d() {
    let server = binary(&[]).await;
    server.register("e", 0, 0, "tcp://h:1").await;
    let (status, _, _) = server
        .send(
            reqwest::Method::POST,
            "/register_worker",
            Some(json!({"dp_rank": 3, "tp_rank": 0, "worker_addr": "tcp://h:9"})),
            None,
        )
        .await;
    assert_eq!(status, 200);
    // /query leaves them out; the request-keyed routes and /workers still see them.
    let parsed = parse_like_vllm_d(&server.get("/query").await);
    assert_eq!(
        parsed,
        vec![("0".into(), "e".into(), vec!["tcp://h:1".into()])]
    );
    assert_eq!(
        server.get("/workers").await["workers"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

#[tokio::test]
async fn the_write_allow_list_admits_its_networks_and_refuses_others_with_403() {
    let allowed = binary(&["--allow-writes-from", "127.0.0.0/8,10.0.0.0/8"]).await;
    assert_eq!(allowed.register("e", 0, 0, "tcp://h:1").await.0, 200);

    let denied = binary(&["--allow-writes-from", "10.0.0.0/8, 192.168.0.1"]).await;
    let (status, body) = denied.register("e", 0, 0, "tcp://h:1").await;
    assert_eq!(status, 403);
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("--allow-writes-from") && detail.contains("127.0.0.1"),
        "{detail}"
    );
    // Reads stay open.
    assert_eq!(denied.get("/query").await, json!({}));

    // With a token as well: peers outside the list write with the token, in any case of the
    // scheme (RFC 9110).
    let both = binary(&[
        "--allow-writes-from",
        "10.0.0.0/8",
        "--auth-token",
        "s3cret",
    ])
    .await;
    let body =
        json!({"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"});
    let (status, content_type, _) = both
        .send(reqwest::Method::POST, "/register", Some(body.clone()), None)
        .await;
    assert_eq!((status, content_type.as_str()), (401, "application/json"));
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let auth = format!("{scheme} s3cret");
        let (status, _, _) = both
            .send(
                reqwest::Method::POST,
                "/register",
                Some(body.clone()),
                Some(&auth),
            )
            .await;
        assert_eq!(status, 200, "{scheme}");
    }
}

#[tokio::test]
async fn an_unprotected_server_says_so_in_health_and_metrics() {
    // The test binary binds 127.0.0.1, which is not exposed: no warning.
    let local = binary(&[]).await;
    assert_eq!(local.get("/health").await, json!({"status": "ok"}));
    let metrics = reqwest::get(format!("{}/metrics", local.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("bootstrap_writes_unprotected 0"),
        "{metrics}"
    );
}

#[tokio::test]
async fn every_error_is_json_even_below_the_routes() {
    let server = binary(&[]).await;
    let json_body = |answer: &str| {
        let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((answer, ""));
        let head = head.to_ascii_lowercase();
        assert!(head.contains("content-type: application/json"), "{answer}");
        if !head.starts_with("http/1.1 405") || !body.is_empty() {
            let parsed: Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("{answer}"));
            assert!(parsed["detail"].is_string(), "{answer}");
        }
        head.split_whitespace().nth(1).unwrap().to_owned()
    };
    let close = "host: x\r\nconnection: close\r\n";
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            format!("GET /nowhere HTTP/1.1\r\n{close}\r\n").into_bytes(),
            "404",
        ),
        (
            format!("PUT /query HTTP/1.1\r\n{close}content-length: 0\r\n\r\n").into_bytes(),
            "405",
        ),
        (
            format!("HEAD /register HTTP/1.1\r\n{close}\r\n").into_bytes(),
            "405",
        ),
        (
            format!(
                "POST /register HTTP/1.1\r\n{close}content-length: 2000000\r\n\r\n{}",
                "x".repeat(2_000_000)
            )
            .into_bytes(),
            "413",
        ),
        (
            format!("GET /{} HTTP/1.1\r\n{close}\r\n", "a".repeat(70_000)).into_bytes(),
            "414",
        ),
        (
            format!(
                "GET /health HTTP/1.1\r\n{close}{}\r\n",
                (0..150)
                    .map(|i| format!("x-h{i}: v\r\n"))
                    .collect::<String>()
            )
            .into_bytes(),
            "431",
        ),
        (
            format!("GET /health HTTP/1.1\r\n{close}bad header\r\n\r\n").into_bytes(),
            "400",
        ),
        (
            format!("POST /register HTTP/1.1\r\n{close}content-length: abc\r\n\r\n").into_bytes(),
            "400",
        ),
    ];
    for (request, status) in cases {
        let answer = server.raw(&request);
        assert_eq!(json_body(&answer), status, "{answer}");
    }
}
