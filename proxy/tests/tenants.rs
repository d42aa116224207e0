//! Tenants against the real binary (`--api-keys-file`, `--api-key`): each key names its tenant,
//! a tenant over one of its limits gets 429 in OpenAI's shape with `Retry-After` and the
//! `x-ratelimit-*` headers while the others are served, the file is re-read when it changes,
//! the metrics count by tenant, and a file that cannot be used stops the start naming it.

mod common;

use std::time::{Duration, Instant};

use common::binary::{command, in_front_of};
use common::{client, topology, Bootstrap, Mock};
use reqwest::Response;
use serde_json::{json, Value};

const ADMIN_KEY: &str = "admin-key";

const KEYS: &str = r#"
[tenants.limited]
keys = ["sk-limited"]
requests_per_second = 2

[tenants.tokens]
keys = ["sk-tokens"]
output_tokens_per_minute = 100

[tenants.free]
keys = ["sk-free-1", "sk-free-2"]

[tenants.one-at-a-time]
keys = ["sk-one"]
max_concurrent_requests = 1
"#;

struct Proxy {
    engines: (Mock, Bootstrap, Mock),
    _child: tokio::process::Child,
    url: String,
}

async fn proxy(keys: &std::path::Path) -> Proxy {
    let (prefill, bootstrap, decode) = (
        Mock::prefill().await,
        Bootstrap::start(topology(&[(0, "engine-0")])).await,
        Mock::decode().await,
    );
    let keys = keys.display().to_string();
    let args = [
        "--api-keys-file",
        &keys,
        "--api-key",
        "sk-flag",
        "--admin-key",
        ADMIN_KEY,
    ];
    let (child, url) = in_front_of(&prefill, &bootstrap, &[&decode], &args, &[]).await;
    Proxy {
        engines: (prefill, bootstrap, decode),
        _child: child,
        url,
    }
}

async fn complete(url: &str, key: &str, max_tokens: u32) -> Response {
    client()
        .post(format!("{url}/v1/completions"))
        .bearer_auth(key)
        .json(&json!({"prompt": "hi", "max_tokens": max_tokens}))
        .send()
        .await
        .unwrap()
}

fn header(response: &Response, name: &str) -> Option<String> {
    (response.headers().get(name)).map(|value| value.to_str().unwrap().to_owned())
}

#[tokio::test]
async fn each_tenant_is_held_to_its_own_limits() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, KEYS).unwrap();
    let proxy = proxy(&keys).await;

    // Two requests a second for `limited`: the third at once is refused, told when to retry.
    for _ in 0..2 {
        assert_eq!(complete(&proxy.url, "sk-limited", 4).await.status(), 200);
    }
    let refused = complete(&proxy.url, "sk-limited", 4).await;
    assert_eq!(refused.status(), 429);
    let retry: u64 = header(&refused, "retry-after").unwrap().parse().unwrap();
    assert!((1..=2).contains(&retry), "{retry}");
    assert!(header(&refused, "retry-after-ms").is_some());
    assert_eq!(
        header(&refused, "x-ratelimit-limit-requests").as_deref(),
        Some("2")
    );
    assert_eq!(
        header(&refused, "x-ratelimit-remaining-requests").as_deref(),
        Some("0")
    );
    assert!(header(&refused, "x-ratelimit-reset-requests")
        .unwrap()
        .ends_with('s'));
    let error: Value = refused.json().await.unwrap();
    assert_eq!(error["error"]["code"], "rate_limit_exceeded");
    assert_eq!(error["error"]["type"], "requests");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limited"),
        "{error}"
    );

    // Meanwhile `free` (either key) and `--api-key`'s tenant are served.
    for key in [
        "sk-free-1",
        "sk-free-2",
        "sk-flag",
        "sk-free-1",
        "sk-free-2",
        "sk-flag",
    ] {
        assert_eq!(complete(&proxy.url, key, 4).await.status(), 200, "{key}");
    }

    // Output tokens are charged as `max_tokens`: 60 of 100 fit, then 60 more do not.
    let first = complete(&proxy.url, "sk-tokens", 60).await;
    assert_eq!(first.status(), 200);
    assert_eq!(
        header(&first, "x-ratelimit-limit-tokens").as_deref(),
        Some("100")
    );
    assert_eq!(
        header(&first, "x-ratelimit-remaining-tokens").as_deref(),
        Some("40")
    );
    let over = complete(&proxy.url, "sk-tokens", 60).await;
    assert_eq!(over.status(), 429);
    assert!(header(&over, "retry-after").is_some());
    assert_eq!(
        over.json::<Value>().await.unwrap()["error"]["type"],
        "tokens"
    );
    // A request that could never fit says so, without a time to come back.
    let never = complete(&proxy.url, "sk-tokens", 500).await;
    assert_eq!(never.status(), 429);
    assert!(header(&never, "retry-after").is_none());
    let message = never.json::<Value>().await.unwrap()["error"]["message"].clone();
    assert!(
        message.as_str().unwrap().contains("max_tokens"),
        "{message}"
    );

    // An unknown key is OpenAI's invalid_api_key.
    let unknown = complete(&proxy.url, "sk-nobody", 4).await;
    assert_eq!(unknown.status(), 401);
    assert_eq!(
        unknown.json::<Value>().await.unwrap()["error"]["code"],
        "invalid_api_key"
    );

    // The metrics count by tenant (every tenant's series present).
    let metrics = (client()
        .get(format!("{}/metrics", proxy.url))
        .bearer_auth(ADMIN_KEY))
    .send()
    .await
    .unwrap()
    .text()
    .await
    .unwrap();
    let value = |series: &str| -> f64 {
        let line = metrics.lines().find(|line| line.starts_with(series));
        line.unwrap_or_else(|| panic!("{series} missing"))
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(
        value(r#"pd_proxy_tenant_rate_limited_total{limit="requests",tenant="limited"}"#),
        1.0
    );
    assert_eq!(
        value(r#"pd_proxy_tenant_rate_limited_total{limit="output_tokens",tenant="tokens"}"#),
        2.0
    );
    assert_eq!(
        value(r#"pd_proxy_tenant_requests_total{tenant="free"}"#),
        4.0
    );
    assert_eq!(
        value(r#"pd_proxy_tenant_rate_limited_total{limit="concurrency",tenant="free"}"#),
        0.0
    );
    assert!(!metrics.contains("sk-"), "no key in the metrics");
}

#[tokio::test]
async fn a_tenant_has_at_most_its_requests_in_flight_until_their_answers_end() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(&keys, KEYS).unwrap();
    let proxy = proxy(&keys).await;
    proxy
        .engines
        .2
        .set(|b| b.chunk_gap = Duration::from_millis(400));
    let streamed = client()
        .post(format!("{}/v1/completions", proxy.url))
        .bearer_auth("sk-one")
        .json(&json!({"prompt": "hi", "max_tokens": 4, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(streamed.status(), 200);
    // Its answer still streams: a second request waits for it.
    let second = complete(&proxy.url, "sk-one", 4).await;
    assert_eq!(second.status(), 429);
    assert!(header(&second, "retry-after").is_some());
    assert!(second.text().await.unwrap().contains("in flight"));
    assert_eq!(
        complete(&proxy.url, "sk-free-1", 4).await.status(),
        200,
        "others go on"
    );
    streamed.text().await.unwrap();
    proxy.engines.2.set(|b| b.chunk_gap = Duration::ZERO);
    assert_eq!(complete(&proxy.url, "sk-one", 4).await.status(), 200);
}

#[tokio::test]
async fn the_keys_file_is_re_read_when_it_changes() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.json");
    std::fs::write(&keys, r#"{"tenants": {"a": {"keys": ["sk-old"]}}}"#).unwrap();
    let proxy = proxy(&keys).await;
    assert_eq!(complete(&proxy.url, "sk-old", 4).await.status(), 200);
    std::fs::write(
        &keys,
        r#"{"tenants": {"a": {"keys": ["sk-new"]}, "b": {"keys": ["sk-b"]}}}"#,
    )
    .unwrap();
    let started = Instant::now();
    while complete(&proxy.url, "sk-new", 4).await.status() != 200 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the new key never worked"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(complete(&proxy.url, "sk-b", 4).await.status(), 200);
    assert_eq!(
        complete(&proxy.url, "sk-old", 4).await.status(),
        401,
        "a key taken out"
    );
    // A broken file leaves the keys as they were.
    std::fs::write(&keys, "{ not json").unwrap();
    tokio::time::sleep(pd_router::tenants::RELOAD_EVERY * 2).await;
    assert_eq!(complete(&proxy.url, "sk-new", 4).await.status(), 200);
}

#[tokio::test]
async fn a_keys_file_that_cannot_be_used_stops_the_start_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(
        &keys,
        "[tenants.a]\nkeys = [\"sk-secret\"]\nrequests_per_second = -1\n",
    )
    .unwrap();
    let path = keys.display().to_string();
    let fleet = [
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:1",
    ];
    let args: Vec<&str> = fleet
        .into_iter()
        .chain(["--api-keys-file", &path])
        .collect();
    let output = command(&args, &[]).output().await.unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("keys.toml") && stderr.contains("requests_per_second"),
        "{stderr}"
    );
    assert!(!stderr.contains("sk-secret"), "{stderr}");
}
