//! SGLang's bootstrap wire against the real binary, with the bodies SGLang's own prefill and
//! decode send: registration of every rank, the topology and rank lookups (also for a decode
//! with another TP size), readiness, bootstrap rooms and their expiry, a kill -9 in the middle,
//! and who may write.

mod common;

use std::ffi::OsStr;
use std::time::Duration;

use common::binary::start_binary;
use reqwest::StatusCode;
use serde_json::{json, Value};

struct Prefill {
    child: tokio::process::Child,
    dir: tempfile::TempDir,
    url: String,
}

async fn start(flags: &[&str]) -> Prefill {
    let dir = tempfile::tempdir().unwrap();
    start_in(dir, flags).await
}

async fn start_in(dir: tempfile::TempDir, flags: &[&str]) -> Prefill {
    let mut args: Vec<&OsStr> = vec![OsStr::new("--data-dir"), dir.path().as_os_str()];
    args.extend(flags.iter().map(OsStr::new));
    let (child, url) = start_binary(&args).await;
    Prefill { child, dir, url }
}

/// The row SGLang's prefill rank `tp` of dp group `dp` sends (attention tp 2, dp 2 as system
/// dp, as `CommonKVManager` builds it).
fn row(dp: u32, tp: u32, port: u16) -> Value {
    json!({
        "attn_tp_size": 2, "attn_tp_rank": tp, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 2, "system_dp_rank": dp,
        "rank_ip": "10.0.0.5", "rank_port": port,
        "page_size": 64, "kv_cache_dtype": "bfloat16",
        "load_balance_method": "follow_bootstrap_room", "prefill_http_port": 30000,
        "decode_allocation_policy": "early"
    })
}

async fn call(
    method: reqwest::Method,
    url: String,
    body: Option<Value>,
    token: Option<&str>,
) -> (StatusCode, String, String) {
    let client = reqwest::Client::new();
    let mut request = client.request(method, url).timeout(Duration::from_secs(10));
    if let Some(body) = body {
        request = request.json(&body);
    }
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, content_type, response.text().await.unwrap())
}

impl Prefill {
    async fn put(&self, body: Value) -> (StatusCode, String) {
        let (status, _, text) = call(
            reqwest::Method::PUT,
            format!("{}/route", self.url),
            Some(body),
            None,
        )
        .await;
        (status, text)
    }

    async fn route(&self, dp: i64, cp: i64, tp: i64, pp: i64) -> (StatusCode, String) {
        let url = format!(
            "{}/route?prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}&target_pp_rank={pp}",
            self.url
        );
        let (status, _, text) = call(reqwest::Method::GET, url, None, None).await;
        (status, text)
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, String) {
        let (status, _, text) = call(
            reqwest::Method::POST,
            format!("{}{path}", self.url),
            Some(body),
            None,
        )
        .await;
        (status, text)
    }

    async fn register_all(&self) {
        for (dp, tp, port) in [(0, 0, 17000), (0, 1, 17001), (1, 0, 17002), (1, 1, 17003)] {
            assert_eq!(
                self.put(row(dp, tp, port)).await,
                (StatusCode::OK, "OK".into())
            );
        }
    }
}

#[tokio::test]
async fn prefill_ranks_register_and_decodes_find_them() {
    let server = start(&[]).await;
    // Until every rank of dp x cp x tp x pp has registered, both forms answer SGLang's 503.
    assert_eq!(
        server.route(-1, -1, -1, -1).await,
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "Prefill server not fully registered yet (0 workers registered).".into()
        )
    );
    server.put(row(0, 0, 17000)).await;
    assert_eq!(
        server.route(0, 0, 0, 0).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    server.register_all().await;

    let (status, topology) = server.route(-1, -1, -1, -1).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_str::<Value>(&topology).unwrap(),
        json!({"attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 2, "pp_size": 1, "page_size": 64,
               "kv_cache_dtype": "bfloat16", "follow_bootstrap_room": true,
               "enable_dsa_cache_layer_split": false, "enable_kv_cache_sharding": false,
               "prefill_http_port": 30000, "decode_allocation_policy": "early"})
    );
    let (status, info) = server.route(1, 0, 1, 0).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_str::<Value>(&info).unwrap(),
        json!({"rank_ip": "10.0.0.5", "rank_port": 17003})
    );
    // A decode with attention TP 4 maps its ranks e to prefill rank e / 2; one with TP 1 reads
    // both prefill ranks [0, 2).
    for decode_rank in 0..4 {
        let (status, _) = server.route(0, 0, decode_rank / 2, 0).await;
        assert_eq!(status, StatusCode::OK, "decode rank {decode_rank}");
    }
    assert_eq!(
        server.route(0, 0, 2, 0).await,
        (
            StatusCode::NOT_FOUND,
            "Bootstrap info not found for dp_rank=0 cp_rank=0 tp_rank=2 pp_rank=0".into()
        )
    );
    // Missing or empty parameters: SGLang's 400 text; a non-integer is a 400 too (never a 500).
    let (status, _, text) = call(
        reqwest::Method::GET,
        format!(
            "{}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=",
            server.url
        ),
        None,
        None,
    )
    .await;
    assert_eq!(
        (status, text.as_str()),
        (
            StatusCode::BAD_REQUEST,
            "Missing inputs for bootstrap server."
        )
    );
    let (status, _) = server.route(0, 0, 0, 0).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = call(
        reqwest::Method::GET,
        format!(
            "{}/route?prefill_dp_rank=x&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0",
            server.url
        ),
        None,
        None,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    // A rank registered again with another allocation policy is refused, as SGLang does.
    let mut late = row(0, 0, 17000);
    late["decode_allocation_policy"] = json!("late");
    assert_eq!(
        server.put(late).await,
        (
            StatusCode::BAD_REQUEST,
            "Inconsistent prefill allocation policies".into()
        )
    );
    // Likewise another DeepSeek V4.1 layout, checked first (both differ here).
    let mut other_layout = row(0, 1, 17001);
    other_layout["dsv41_spec_layout"] = json!({"draft": 1});
    other_layout["decode_allocation_policy"] = json!("late");
    assert_eq!(
        server.put(other_layout).await,
        (
            StatusCode::BAD_REQUEST,
            "DeepSeek-V4.1 DSpark PD layout differs across prefill ranks".into()
        )
    );
    // The rows are in the native view and the watch, under the deployment's engine id.
    let (_, _, workers) = call(
        reqwest::Method::GET,
        format!("{}/workers", server.url),
        None,
        None,
    )
    .await;
    let workers: Value = serde_json::from_str(&workers).unwrap();
    assert_eq!(workers["workers"].as_array().unwrap().len(), 4);
    assert_eq!(workers["workers"][0]["engine_id"], "sglang-prefill");
    let metrics = reqwest::get(format!("{}/metrics", server.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains(r#"bootstrap_registrations_total{dialect="sglang",outcome="created"} 4"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_restarted_prefill_replaces_its_ranks() {
    let server = start(&[]).await;
    server.register_all().await;
    // The restarted prefill's ranks come back on new ports: the first one starts a new run.
    assert_eq!(server.put(row(0, 0, 18000)).await.0, StatusCode::OK);
    assert_eq!(
        server.route(-1, -1, -1, -1).await.0,
        StatusCode::SERVICE_UNAVAILABLE,
        "the previous run's other ranks left: not fully registered until the rest come back"
    );
    for (dp, tp, port) in [(0, 1, 18001), (1, 0, 18002), (1, 1, 18003)] {
        server.put(row(dp, tp, port)).await;
    }
    let (_, info) = server.route(1, 0, 1, 0).await;
    assert_eq!(
        serde_json::from_str::<Value>(&info).unwrap()["rank_port"],
        18003
    );
}

#[tokio::test]
async fn bootstrap_rooms_map_to_dp_ranks_and_expire() {
    let server = start(&["--room-ttl", "1"]).await;
    let big = (1u64 << 63) - 1;
    for (room, dp) in [(7u64, 1u32), (big, 0)] {
        assert_eq!(
            server
                .post(
                    "/register_dp_rank",
                    json!({"bootstrap_room": room, "dp_rank": dp})
                )
                .await,
            (StatusCode::OK, "OK".into())
        );
    }
    let (status, answer) = server
        .post("/query_dp_ranks", json!({"bootstrap_rooms": [7, big, 99]}))
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_str::<Value>(&answer).unwrap(),
        json!({"7": 1, big.to_string(): 0}),
        "unknown rooms are left out"
    );
    // A later registration moves a room, as in SGLang.
    server
        .post(
            "/register_dp_rank",
            json!({"bootstrap_room": 7, "dp_rank": 0}),
        )
        .await;
    let (_, answer) = server
        .post("/query_dp_ranks", json!({"bootstrap_rooms": [7]}))
        .await;
    assert_eq!(
        serde_json::from_str::<Value>(&answer).unwrap(),
        json!({"7": 0})
    );
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let (_, answer) = server
        .post("/query_dp_ranks", json!({"bootstrap_rooms": [7, big]}))
        .await;
    assert_eq!(
        serde_json::from_str::<Value>(&answer).unwrap(),
        json!({}),
        "expired"
    );
}

#[tokio::test]
async fn registrations_survive_kill_9() {
    let server = start(&[]).await;
    server.register_all().await;
    server
        .post(
            "/register_dp_rank",
            json!({"bootstrap_room": 42, "dp_rank": 1}),
        )
        .await;
    let Prefill { mut child, dir, .. } = server;
    child.start_kill().unwrap();
    child.wait().await.unwrap();
    let server = start_in(dir, &[]).await;
    let (status, info) = server.route(0, 0, 1, 0).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        serde_json::from_str::<Value>(&info).unwrap()["rank_port"],
        17001
    );
}

#[tokio::test]
async fn writes_follow_the_write_guard_and_reads_stay_open() {
    let server = start(&["--auth-token", "s3cret"]).await;
    let (status, _, text) = call(
        reqwest::Method::PUT,
        format!("{}/route", server.url),
        Some(row(0, 0, 1)),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{text}");
    let (status, _, _) = call(
        reqwest::Method::PUT,
        format!("{}/route", server.url),
        Some(row(0, 0, 1)),
        Some("s3cret"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = call(
        reqwest::Method::POST,
        format!("{}/register_dp_rank", server.url),
        Some(json!({"bootstrap_room": 1, "dp_rank": 0})),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // Reads need no token.
    assert_eq!(
        server.route(-1, -1, -1, -1).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        server
            .post("/query_dp_ranks", json!({"bootstrap_rooms": [1]}))
            .await
            .0,
        StatusCode::OK
    );
    // A bad body is a 4xx naming the field, never SGLang's 500.
    let (status, _) = {
        let (status, _, text) = call(
            reqwest::Method::PUT,
            format!("{}/route", server.url),
            Some(json!({"attn_tp_size": 2})),
            Some("s3cret"),
        )
        .await;
        (status, text)
    };
    assert!(status.is_client_error(), "{status}");
}
