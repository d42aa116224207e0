//! Every kind of bad input gets a 4xx JSON error naming the problem: never a 500, a panic or a hang.

mod common;

use bootstrap_server::registry::ExpectedTopology;
use reqwest::Method;
use serde_json::{json, Value};

fn raw(text: &str) -> Value {
    Value::String(format!("RAW:{text}"))
}

async fn bad_input_table() {
    let server = common::start_with(|c| {
        c.registry.expected = Some(ExpectedTopology {
            dp_size: 4,
            tp_size: 4,
            pp_size: 1,
        })
    })
    .await;
    let reg = |engine: Value, dp: Value, addr: Value| json!({"engine_id": engine, "dp_rank": dp, "tp_rank": 0, "pp_rank": 0, "addr": addr});
    let long_id = "x".repeat(300);
    let long_addr = format!("tcp://{}:1", "h".repeat(600));
    let too_many_ids: Vec<String> = (0..5000).map(|i| format!("r{i}")).collect();
    let cases: Vec<(Method, &str, Option<Value>, u16, &str)> = vec![
        (
            Method::POST,
            "/register",
            Some(raw("{not json")),
            400,
            "JSON",
        ),
        (Method::POST, "/register", Some(raw("")), 400, "EOF"),
        (
            Method::POST,
            "/register",
            Some(json!({"dp_rank": 0})),
            422,
            "engine_id",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!(5), json!(0), json!("tcp://h:1"))),
            422,
            "engine_id",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!("e"), json!(-1), json!("tcp://h:1"))),
            422,
            "dp_rank",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!("e"), json!("zero"), json!("tcp://h:1"))),
            422,
            "dp_rank",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!("e"), json!(1.5), json!("tcp://h:1"))),
            422,
            "dp_rank",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!("e"), json!(99999999999u64), json!("tcp://h:1"))),
            422,
            "dp_rank",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!("e"), json!(70000), json!("tcp://h:1"))),
            422,
            "dp_rank",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!("e"), json!(4), json!("tcp://h:1"))),
            400,
            "DP size 4",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!(""), json!(0), json!("tcp://h:1"))),
            422,
            "engine_id",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!(long_id), json!(0), json!("tcp://h:1"))),
            422,
            "engine_id",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!("e"), json!(0), json!(""))),
            422,
            "addr",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!("e"), json!(0), json!("not an address"))),
            422,
            "addr",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!("e"), json!(0), json!("tcp://h"))),
            422,
            "addr",
        ),
        (
            Method::POST,
            "/register",
            Some(reg(json!("e"), json!(0), json!(long_addr))),
            422,
            "addr",
        ),
        (
            Method::POST,
            "/register",
            Some(json!([1, 2])),
            422,
            "invalid type",
        ),
        (
            Method::POST,
            "/register",
            Some(raw(&format!("\"{}\"", "a".repeat(2 << 20)))),
            413,
            "length limit",
        ),
        (
            Method::DELETE,
            "/register",
            Some(json!({})),
            422,
            "engine_id",
        ),
        (
            Method::POST,
            "/register_worker",
            Some(json!({"dp_rank": 0, "tp_rank": 0})),
            422,
            "worker_addr",
        ),
        (
            Method::POST,
            "/register_request",
            Some(json!({"req_id": "", "dp_rank": 0})),
            422,
            "req_id",
        ),
        (
            Method::POST,
            "/register_request",
            Some(json!({"req_id": "r", "dp_rank": null})),
            422,
            "dp_rank",
        ),
        (
            Method::POST,
            "/register_request",
            Some(json!({"req_id": "r", "dp_rank": 9})),
            400,
            "DP size",
        ),
        (
            Method::POST,
            "/query_requests",
            Some(json!({"req_ids": "r", "tp_rank": 0, "tp_size": 4})),
            422,
            "req_ids",
        ),
        (
            Method::POST,
            "/query_requests",
            Some(json!({"req_ids": [""], "tp_rank": 0, "tp_size": 4})),
            422,
            "req_ids",
        ),
        (
            Method::POST,
            "/query_requests",
            Some(json!({"req_ids": too_many_ids, "tp_rank": 0, "tp_size": 4})),
            422,
            "req_ids",
        ),
        (
            Method::POST,
            "/query_requests",
            Some(json!({"req_ids": [], "tp_size": 4})),
            422,
            "tp_rank",
        ),
        (Method::GET, "/query?engine_id=", None, 422, "engine_id"),
        (Method::DELETE, "/requests/%0A", None, 422, "req_id"),
        (Method::GET, "/nope", None, 404, "/nope"),
        (Method::GET, "/register", None, 405, "GET"),
        (Method::PUT, "/query", None, 405, "PUT"),
    ];
    for (method, path, body, want_status, want_text) in cases {
        let (status, answer) = server.call(method.clone(), path, body).await;
        let detail = answer["detail"].as_str().unwrap_or_default().to_owned();
        assert_eq!(status.as_u16(), want_status, "{method} {path}: {answer}");
        assert!(
            detail.contains(want_text),
            "{method} {path}: {detail:?} lacks {want_text:?}"
        );
    }
    // Nothing bad was recorded, and the server still answers.
    assert_eq!(server.get("/ready").await.1["registered"], 0);
}

on_both_backends!("current_thread"; bad_input_table);
