//! `precise_prefix`: pd-proxy tokenizes each prompt as the engine does (`--tokenizer`) and sends
//! it where the engines' own KV cache events say its prefix is held, weighed against load; the
//! reason is in `x-pd-route` and `pd_proxy_route_picks_total`; without events or tokens it
//! falls back to cache_aware; `POST /admin/kv-index/match` shows the match per engine.

mod common;

use std::time::{Duration, Instant};

use common::kv_publisher::{stored_tokens, Publisher};
use common::*;
use pd_protocol::kv_events::KvEvent;
use pd_proxy::config::KvEventsConfig;
use pd_proxy::config::Policy;
use pd_proxy::ProxyHandle;
use serde_json::{json, Value};

const KEY: &str = "admin-key";
const BLOCK: usize = 16;

/// Two prefills and two decodes, each publishing its KV events, behind a proxy routing both
/// choices with precise_prefix on a byte-level tokenizer (a token per byte).
struct Cluster {
    prefills: Vec<Mock>,
    decodes: Vec<Mock>,
    publishers: Vec<Publisher>,
    /// Each publisher's next sequence number.
    next_seq: Vec<u64>,
    proxy: ProxyHandle,
    _bootstrap: Bootstrap,
    _tokenizer: tempfile::TempDir,
}

impl Cluster {
    async fn start(edit: impl FnOnce(&mut pd_proxy::Config)) -> Self {
        let tokenizer = tempfile::tempdir().unwrap();
        pd_tokenize::byte_level::write(tokenizer.path()).unwrap();
        let bootstrap = Bootstrap::start(topology(&[(0, "engine-0")])).await;
        let mut publishers = Vec::new();
        let mut prefills = Vec::new();
        let mut decodes = Vec::new();
        for i in 0..4 {
            let publisher = Publisher::start(false).await;
            let mock = if i < 2 {
                Mock::prefill().await
            } else {
                Mock::decode().await
            };
            mock.set_kv_event_sources(publisher.sources());
            publishers.push(publisher);
            if i < 2 {
                prefills.push(mock)
            } else {
                decodes.push(mock)
            }
        }
        let targets = prefills
            .iter()
            .map(|p| target(p, &bootstrap.url()))
            .collect();
        let mut config = config(targets, decodes.iter().map(Mock::url).collect());
        config.admin_key = Some(KEY.to_owned());
        // The metrics the tests read are left open to scrapers (a key is set).
        config.metrics_open = true;
        config.router.routing.prefill_policy = Policy::PrecisePrefix;
        config.router.routing.decode_policy = Policy::PrecisePrefix;
        config.router.kv_events = Some(KvEventsConfig {
            rescan: Duration::from_millis(100),
            tokenizer: Some(tokenizer.path().to_owned()),
            ..KvEventsConfig::default()
        });
        edit(&mut config);
        let proxy = start_proxy(config).await;
        let mut cluster = Cluster {
            prefills,
            decodes,
            publishers,
            next_seq: Vec::new(),
            proxy,
            _bootstrap: bootstrap,
            _tokenizer: tokenizer,
        };
        cluster.sync().await;
        cluster
    }

    /// Publishes empty batches until every subscription sees them (a SUB socket misses what
    /// is published before it is connected).
    async fn sync(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        for i in 0..self.publishers.len() {
            let endpoint = self.publishers[i].endpoint.clone();
            let mut seq = 0;
            loop {
                assert!(
                    Instant::now() < deadline,
                    "publisher {i} never reached the proxy"
                );
                let publisher = &mut self.publishers[i];
                publisher
                    .publish(seq, vec![KvEvent::AllBlocksCleared], true)
                    .await;
                tokio::time::sleep(Duration::from_millis(30)).await;
                let report = self.report().await;
                let seen = report["engines"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|e| e["endpoint"] == endpoint.as_str() && e["last_seq"] == seq);
                if seen {
                    break;
                }
                seq += 1;
            }
            self.next_seq.push(seq + 1);
        }
    }

    /// Engine `i` (prefills 0 and 1, decodes 2 and 3) announces `tokens`' whole blocks.
    async fn holds(&mut self, i: usize, tokens: &[u32]) {
        let seq = self.next_seq[i];
        self.next_seq[i] += 1;
        let hash = 1_000_000 * (i as i128 + 1) + seq as i128 * 1_000;
        let event = stored_tokens(hash, tokens, BLOCK, None);
        self.publishers[i].publish(seq, vec![event], true).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        let endpoint = self.publishers[i].endpoint.clone();
        loop {
            let report = self.report().await;
            let applied = report["engines"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["endpoint"] == endpoint.as_str() && e["last_seq"] == seq);
            if applied {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "engine {i}'s blocks never reached the index"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Sends `body` to `/v1/completions` asking why; the answer's `x-pd-route`.
    async fn route(&self, body: Value) -> String {
        let answer = client()
            .post(format!("{}/v1/completions", self.proxy.url()))
            .header("x-pd-route", "1")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
        answer.headers()["x-pd-route"].to_str().unwrap().to_owned()
    }

    async fn report(&self) -> Value {
        json_of(
            client()
                .get(format!("{}/admin/kv-index", self.proxy.url()))
                .bearer_auth(KEY),
        )
        .await
    }
}

fn bytes(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// A 64-token prompt (64 bytes) starting with `tag`.
fn prompt(tag: char) -> String {
    format!("{tag}{}", "x".repeat(63))
}

#[tokio::test]
async fn a_prompt_goes_where_its_prefix_is_held() {
    let mut cluster = Cluster::start(|_| {}).await;
    let text = prompt('a');
    // Prefill 1 holds three of its four blocks; decode 3 holds two.
    cluster.holds(1, &bytes(&text)[..48]).await;
    cluster.holds(3, &bytes(&text)[..32]).await;
    for _ in 0..3 {
        let route = cluster
            .route(json!({"model": "mock-model", "prompt": text, "max_tokens": 2}))
            .await;
        assert!(
            route.contains(&format!("prefill={}", cluster.prefills[1].url())),
            "{route}"
        );
        assert!(
            route.contains(&format!("decode={}", cluster.decodes[1].url())),
            "{route}"
        );
        assert!(route.contains("prompt_tokens=64; prefill_pick=kv_hit; prefill_cached_tokens=48; decode_pick=kv_hit; decode_cached_tokens=32"), "{route}");
    }
    // A prompt nobody holds: a miss, spread over the idle candidates.
    let route = cluster.route(json!({"prompt": prompt('b')})).await;
    assert!(
        route.contains("prefill_pick=kv_miss; prefill_cached_tokens=0"),
        "{route}"
    );
    // Token ids sent by the client are used as they are.
    let route = cluster.route(json!({"prompt": bytes(&text)})).await;
    assert!(route.contains("prefill_cached_tokens=48"), "{route}");
    // A long prompt (tokenized on a blocking thread) is matched the same way.
    let long = format!("{}{}", "L".repeat(4096), "tail");
    cluster.holds(0, &bytes(&long)[..4096]).await;
    let route = cluster.route(json!({"prompt": long})).await;
    assert!(
        route.contains(&format!("prefill={}", cluster.prefills[0].url())),
        "{route}"
    );
    assert!(
        route.contains("prompt_tokens=4100; prefill_pick=kv_hit; prefill_cached_tokens=4096"),
        "{route}"
    );
    // A cache salt names other blocks.
    let route = cluster
        .route(json!({"prompt": text, "cache_salt": "tenant-2"}))
        .await;
    assert!(route.contains("prefill_pick=kv_miss"), "{route}");
    let metrics = metrics(&cluster.proxy).await;
    assert_eq!(
        sample(
            &metrics,
            "pd_proxy_route_picks_total",
            r#"choice="prefill",reason="kv_hit""#
        ),
        5.0
    );
    assert_eq!(
        sample(
            &metrics,
            "pd_proxy_route_picks_total",
            r#"choice="decode",reason="kv_miss""#
        ),
        3.0
    );
    assert!(
        sample(
            &metrics,
            "pd_proxy_tokenize_seconds_count",
            r#"source="local""#
        ) >= 5.0
    );
    // The admin's view of the same prompt.
    let matched = json_of(
        client()
            .post(format!("{}/admin/kv-index/match", cluster.proxy.url()))
            .bearer_auth(KEY)
            .json(&json!({"prompt": text})),
    )
    .await;
    assert_eq!(matched["prompt_tokens"], 64, "{matched}");
    assert_eq!(
        matched["engines"][0]["backend"],
        cluster.prefills[1].url(),
        "{matched}"
    );
    assert_eq!(matched["engines"][0]["cached_tokens"], 48, "{matched}");
    assert_eq!(matched["engines"][1]["cached_tokens"], 32, "{matched}");
    assert_eq!(matched["engines"][2]["cached_tokens"], 0, "{matched}");
    cluster.proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn queued_work_outweighs_a_partial_hit() {
    // A token waiting weighs as much as a token computed (--kv-load-weight 1).
    let mut cluster = Cluster::start(|config| config.router.routing.kv_load_weight = 1.0).await;
    let text = prompt('c');
    cluster.holds(0, &bytes(&text)[..48]).await;
    // Prefill 0 holds 48 of the prompt's 64 tokens: each request costs it 16 to compute, plus
    // the 16 of each one already waiting there; idle prefill 1 would compute all 64. So the
    // first four go to prefill 0 (the fourth ties at 64 and goes to the holder), the fifth to
    // prefill 1.
    cluster.prefills[0].set(|b| b.delay = Duration::from_millis(1500));
    let mut busy = Vec::new();
    for n in 1..=4 {
        let url = cluster.proxy.url();
        let body = json!({"prompt": text});
        busy.push(tokio::spawn(async move {
            client()
                .post(format!("{url}/v1/completions"))
                .json(&body)
                .send()
                .await
        }));
        cluster.prefills[0].wait_seen(n).await;
    }
    let route = cluster.route(json!({"prompt": text})).await;
    assert!(
        route.contains(&format!("prefill={}", cluster.prefills[1].url())),
        "{route}"
    );
    assert!(route.contains("prefill_pick=kv_miss"), "{route}");
    for request in busy {
        assert_eq!(request.await.unwrap().unwrap().status(), 200);
    }
    // Their work done (P's calls over, not only D's answers), the holder is the cheapest again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let url = format!("{}/admin/backends", cluster.proxy.url());
        let backends = json_of(client().get(url).bearer_auth(KEY)).await;
        if backends["prefills"][0]["in_flight"] == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{backends}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let route = cluster.route(json!({"prompt": text})).await;
    assert!(route.contains("prefill_pick=kv_hit"), "{route}");
    cluster.proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_decode_holding_the_prompt_serves_it_alone() {
    let mut cluster = Cluster::start(|config| {
        config.router.routing.decode_only.prefix_share = Some(0.75);
    })
    .await;
    let text = prompt('d');
    cluster.holds(2, &bytes(&text)).await;
    let route = cluster.route(json!({"prompt": text})).await;
    assert!(
        route.starts_with("decision=decode_only; reason=prefix_hit"),
        "{route}"
    );
    assert!(
        route.contains(&format!("decode={}", cluster.decodes[0].url())),
        "{route}"
    );
    assert!(cluster.prefills.iter().all(|p| p.seen().is_empty()));
    // Half of it held: below the share, through P and D.
    let half = format!("{}{}", &text[..32], "y".repeat(32));
    let route = cluster.route(json!({"prompt": half})).await;
    assert!(
        route.starts_with("decision=disaggregated; reason=long_prompt"),
        "{route}"
    );
    cluster.proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn without_tokens_or_events_cache_aware_places_the_request() {
    let cluster = Cluster::start(|_| {}).await;
    // A prompt shape the proxy does not tokenize.
    let route = cluster.route(json!({"prompt": {"not": "a prompt"}})).await;
    assert!(route.contains("prefill_pick=no_tokens"), "{route}");
    cluster.proxy.shutdown().await.unwrap();
    // No engine publishes: every pick says so. Without --tokenizer the engine's own
    // `/tokenize` is asked.
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    let bootstrap = Bootstrap::start(topology(&[(0, "engine-0")])).await;
    let mut config = config(vec![target(&prefill, &bootstrap.url())], vec![decode.url()]);
    config.router.routing.prefill_policy = Policy::PrecisePrefix;
    let proxy = start_proxy(config).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while ready_status(&proxy).await != 200 {
        assert!(Instant::now() < deadline, "the proxy never became ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let answer = client()
        .post(format!("{}/v1/completions", proxy.url()))
        .header("x-pd-route", "1")
        .json(&json!({"prompt": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let route = answer.headers()["x-pd-route"].to_str().unwrap().to_owned();
    assert!(
        route.contains("prompt_tokens=5; prefill_pick=no_events"),
        "{route}"
    );
    let metrics = metrics(&proxy).await;
    assert_eq!(
        sample(
            &metrics,
            "pd_proxy_tokenize_seconds_count",
            r#"source="engine""#
        ),
        1.0
    );
    proxy.shutdown().await.unwrap();
}
