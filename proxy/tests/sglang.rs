//! SGLang mode against the real bootstrap server holding an SGLang prefill's rows: P and D get
//! the client's body at once with `bootstrap_host`, `bootstrap_port` and one `bootstrap_room`
//! whose remainder is the chosen dp rank, on the OpenAI routes and on `/generate`.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use bootstrap_server::{Server, ServerConfig};
use common::*;
use pd_proxy::config::{Mode, PrefillTarget};
use serde_json::json;

/// The row SGLang's prefill rank of dp group `dp` sends (tp 1, dp 2 as system dp).
fn row(dp: u32) -> serde_json::Value {
    json!({
        "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 2, "system_dp_rank": dp,
        "rank_ip": "127.0.0.1", "rank_port": 17000 + dp, "page_size": 64,
        "kv_cache_dtype": "bfloat16"
    })
}

#[tokio::test]
async fn sglang_mode_adds_the_bootstrap_fields_to_both_bodies() {
    let dir = tempfile::tempdir().unwrap();
    let bootstrap = Server::bind(ServerConfig::local(dir.path()))
        .await
        .unwrap()
        .spawn();
    for dp in 0..2 {
        let status = client()
            .put(format!("{}/route", bootstrap.url()))
            .json(&row(dp))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, 200);
    }
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    let target = PrefillTarget {
        url: prefill.url(),
        bootstrap_addr: Some(bootstrap.url()),
    };
    let mut config = config(vec![target], vec![decode.url()]);
    config.router.mode = Mode::Sglang;
    config.router.discovery.sglang = true;
    let proxy = start_proxy(config).await;
    wait_ready(&proxy).await;

    let port = bootstrap.addr().port();
    let mut ranks = BTreeSet::new();
    for (i, path) in [
        "/v1/completions",
        "/generate",
        "/v1/completions",
        "/generate",
    ]
    .iter()
    .enumerate()
    {
        let body = json!({"text": "hi", "prompt": "hi", "stream": true, "sampling_params": {"max_new_tokens": 4}});
        let answer = client()
            .post(format!("{}{path}", proxy.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200, "{path}");
        let _ = answer.text().await;
        let p = prefill.wait_seen(i + 1).await.remove(i);
        let d = decode.wait_seen(i + 1).await.remove(i);
        assert_eq!(p.path, *path);
        assert_eq!(d.path, *path);
        for seen in [&p, &d] {
            assert_eq!(seen.body["bootstrap_host"], "127.0.0.1");
            assert_eq!(seen.body["bootstrap_port"], port);
            assert_eq!(seen.body["text"], "hi", "the rest passes through");
        }
        let room = p.body["bootstrap_room"].as_u64().unwrap();
        assert_eq!(
            d.body["bootstrap_room"].as_u64(),
            Some(room),
            "one room for both"
        );
        assert!(room < 1 << 63);
        assert_eq!(p.body["stream"], false, "P answers whole");
        assert_eq!(d.body["stream"], true);
        ranks.insert(room % 2);
    }
    assert_eq!(
        ranks.len(),
        2,
        "round robin over both dp ranks, carried by the room"
    );
    tokio::time::timeout(Duration::from_secs(5), proxy.shutdown())
        .await
        .unwrap()
        .unwrap();
    bootstrap.shutdown().await.unwrap();
}
