//! A prefill whose ranks register one by one, with pauses, against the real bootstrap-server
//! (default flags but a longer settle window, so the timings below are not close calls) and a
//! real pd-proxy: `GET /query` never shows the engine half (503, with `Retry-After`, until its
//! ranks form a whole grid that stayed unchanged for the window), a whole engine beside it is
//! shown at once, and the proxy routes to the engine only once it is shown, within moments of
//! that (it asks again when the registry says, not at its 30 s interval).

mod common;

use std::time::{Duration, Instant};

use common::{sim_engine, start_binary as start};
use pd_examples::cluster::free_port;
use serde_json::{json, Value};

const SETTLE: Duration = Duration::from_secs(3);

async fn register(bootstrap: &str, engine: &str, dp: u32, tp: u32) {
    let body = json!({"engine_id": engine, "dp_rank": dp, "tp_rank": tp, "pp_rank": 0,
                      "addr": format!("tcp://127.0.0.1:{}", 40000 + dp * 10 + tp)});
    let answer = reqwest::Client::new()
        .post(format!("{bootstrap}/register"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
}

/// `GET /query` (`?engine_id=` `engine`, if given): the status, the `Retry-After` and the body.
async fn query_of(bootstrap: &str, engine: Option<&str>) -> (u16, Option<String>, Value) {
    let asked = engine.map_or(String::new(), |engine| format!("?engine_id={engine}"));
    let answer = reqwest::get(format!("{bootstrap}/query{asked}"))
        .await
        .unwrap();
    let status = answer.status().as_u16();
    let retry = (answer.headers().get("retry-after")).map(|v| v.to_str().unwrap().to_owned());
    (status, retry, answer.json().await.unwrap())
}

/// `GET /query` of every engine.
async fn query(bootstrap: &str) -> (u16, Option<String>, Value) {
    query_of(bootstrap, None).await
}

async fn proxy_ready(proxy: &str) -> bool {
    let answer = reqwest::get(format!("{proxy}/ready")).await.unwrap();
    answer.status() == 200
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_registering_rank_by_rank_is_shown_and_routed_only_once_whole() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let data = dir.path().join("data");
    let settle = SETTLE.as_secs().to_string();
    let args = [
        "--host",
        "127.0.0.1",
        "--port",
        &port,
        "--settle",
        &settle,
        "--data-dir",
    ]
    .map(str::to_owned)
    .into_iter()
    .chain([data.display().to_string()])
    .collect::<Vec<_>>();
    let _bootstrap = start(dir.path(), "bootstrap-server", &args, "/health").await;
    let bootstrap = format!("http://127.0.0.1:{port}");
    // The prefill's API (what the proxy checks before it asks the registry) and a decode.
    let (prefill, _p) = sim_engine(&[], &[]).await;
    let (decode, _d) = sim_engine(&[], &[]).await;
    let proxy_port = free_port().to_string();
    let proxy_args = [
        "--port".to_owned(),
        proxy_port.clone(),
        "--prefill".to_owned(),
        prefill.url.clone(),
        port.clone(),
        "--decode".to_owned(),
        decode.url.clone(),
    ];
    let _proxy = start(dir.path(), "pd-proxy", &proxy_args, "/health").await;
    let proxy = format!("http://127.0.0.1:{proxy_port}");

    // Rank 0 of a tp=2 engine: nothing is shown; a stock D would cache no error.
    register(&bootstrap, "half", 0, 0).await;
    let (status, retry, body) = query(&bootstrap).await;
    assert_eq!(status, 503, "{body}");
    // One rank is a whole grid of tp 1 by itself: only the window tells it from a tp=2 engine
    // half registered.
    assert_eq!(retry.as_deref(), Some("3"), "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(detail.contains("half (1 ranks so far, settling)"), "{body}");
    assert_eq!(query_of(&bootstrap, Some("half")).await.0, 503);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        !proxy_ready(&proxy).await,
        "the proxy routes to no half engine"
    );

    // A whole engine on another dp rank is shown at once once settled; the half one is not.
    register(&bootstrap, "whole", 1, 0).await;
    register(&bootstrap, "half", 0, 1).await;
    let last = Instant::now();
    let (status, retry, body) = query(&bootstrap).await;
    assert_eq!(status, 503, "both still settle: {body}");
    let retry: u64 = retry.unwrap().parse().unwrap();
    assert!((1..=SETTLE.as_secs()).contains(&retry), "{retry}");
    assert_eq!(query_of(&bootstrap, Some("half")).await.0, 503);

    // Once the window passed without a change: the whole grid, both tp ranks.
    while last.elapsed() < SETTLE {
        assert!(
            !proxy_ready(&proxy).await,
            "routed {:?} after the last rank",
            last.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, retry, body) = query(&bootstrap).await;
    assert_eq!((status, retry), (200, None), "{body}");
    assert_eq!(body["0"]["engine_id"], "half");
    assert_eq!(
        body["0"]["worker_addr"].as_object().unwrap().len(),
        2,
        "{body}"
    );
    assert_eq!(body["1"]["engine_id"], "whole");
    // The proxy follows within moments, not at its 30 s discovery interval.
    while !proxy_ready(&proxy).await {
        assert!(
            last.elapsed() < SETTLE + Duration::from_millis(1500),
            "the proxy routes to the whole engine soon after it is shown"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "the proxy was ready {:?} after the last rank registered",
        last.elapsed()
    );

    // A rank that joins later makes the engine settle again; the whole one stays shown.
    register(&bootstrap, "half", 0, 2).await;
    let (status, retry, body) = query(&bootstrap).await;
    assert_eq!(status, 200, "{body}");
    assert!(retry.is_some());
    assert!(
        body.get("0").is_none() && body["1"]["engine_id"] == "whole",
        "{body}"
    );
}
