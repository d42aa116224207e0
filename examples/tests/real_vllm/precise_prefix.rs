//! precise_prefix on real engines: pd-proxy's tokenization (`--tokenizer`, the model's own
//! files) equals vLLM's `/tokenize` for completions and chats, and a prompt sent again goes to
//! the prefill whose KV cache events announced its blocks.

use super::*;

/// The bodies whose tokens must be the engine's: completions and chats, in the shapes clients
/// send.
fn tokenize_cases() -> Vec<Value> {
    let model = vllm::TINY_MODEL_NAME;
    let mut cases: Vec<Value> = [
        SHORT_PROMPT,
        LONG_PROMPT,
        "héllo wörld — ünïcode ✓ 你好 🙂",
        "  leading and trailing spaces  \n\n\ttabs",
        "<|bos|>special<|end|> tokens written as text",
    ]
    .iter()
    .map(|prompt| json!({"model": model, "prompt": prompt}))
    .collect();
    cases.push(json!({"model": model, "prompt": SHORT_PROMPT, "add_special_tokens": false}));
    let turns = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": SHORT_PROMPT},
        {"role": "assistant", "content": "A fox jumped."},
        {"role": "user", "content": [{"type": "text", "text": "And then?"},
                                     {"type": "text", "text": "Say more."}]},
    ]);
    cases.extend([
        json!({"model": model, "messages": [{"role": "user", "content": LONG_PROMPT}]}),
        json!({"model": model, "messages": turns}),
        json!({"model": model, "messages": turns, "add_generation_prompt": false}),
        json!({"model": model, "messages": [{"role": "developer", "content": "Be kind."},
            {"role": "user", "content": "Hi"}]}),
        json!({"model": model, "add_generation_prompt": false, "continue_final_message": true,
            "messages": [{"role": "user", "content": "Count"},
                         {"role": "assistant", "content": "One, two, "}]}),
    ]);
    cases
}

/// The proxy's token ids of `body` (its `POST /admin/kv-index/match`) and its match per engine.
async fn proxy_match(cluster: &Cluster, body: &Value) -> Value {
    let url = format!("{}/admin/kv-index/match", cluster.proxy.url);
    json_of(
        reqwest::Client::new()
            .post(url)
            .bearer_auth("admin")
            .json(body),
    )
    .await
}

/// Sends `body` through the proxy asking why; the answer's `x-pd-route`.
async fn routed(cluster: &Cluster, body: &Value) -> String {
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/completions", cluster.proxy.url))
        .header("x-pd-route", "1")
        .json(body)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    answer.headers()["x-pd-route"].to_str().unwrap().to_owned()
}

/// The `name=value` word of an `x-pd-route` header.
fn word<'a>(route: &'a str, name: &str) -> &'a str {
    route
        .split("; ")
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name} in {route}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precise_prefix_tokenizes_as_the_engine_and_routes_to_the_holder() {
    let _one = ONE_CLUSTER.lock().await;
    let mut engines = engines(Connector::Mooncake).await;
    engines.kv_events = true;
    let (mut spec, _dir) = spec("real-precise-", engines);
    // The cluster gives the proxy --kv-events and --tokenizer (the model's folder).
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; 2];
    spec.proxy_args = ["--policy", "precise_prefix", "--admin-key", "admin"]
        .map(String::from)
        .to_vec();
    let cluster = start(&spec).await;
    wait_kv_index(&cluster, |engines| {
        engines.len() == 3 && engines.iter().all(|e| e["connected"] == true)
    })
    .await;

    // The proxy's tokens are the engine's, id for id.
    let http = reqwest::Client::new();
    for body in tokenize_cases() {
        let engine = json_of(
            http.post(format!("{}/tokenize", cluster.decodes[0].url))
                .json(&body),
        )
        .await;
        let proxy = proxy_match(&cluster, &body).await;
        assert!(
            engine["tokens"].is_array(),
            "the engine's /tokenize of {body}: {engine}"
        );
        assert_eq!(proxy["token_ids"], engine["tokens"], "{body}: {proxy}");
    }

    // A new prompt misses; once its prefill announced its blocks, it goes back there, twice.
    for tenant in ["one", "two"] {
        let body = greedy(
            "/v1/completions",
            &format!("Tenant {tenant}. {LONG_PROMPT}"),
            false,
        );
        let first = routed(&cluster, &body).await;
        assert_eq!(word(&first, "prefill_pick"), "kv_miss", "{first}");
        let home = word(&first, "prefill").to_owned();
        let started = Instant::now();
        let held = loop {
            let matched = proxy_match(&cluster, &body).await;
            let prefills: Vec<&Value> = (matched["engines"].as_array().unwrap().iter())
                .filter(|e| e["role"] == "prefill" && e["cached_tokens"].as_u64() > Some(0))
                .collect();
            if let [holder] = prefills[..] {
                assert_eq!(holder["backend"], home.as_str(), "{matched}");
                break holder["cached_tokens"].as_u64().unwrap();
            }
            assert!(
                prefills.len() < 2,
                "only one prefill computed it: {matched}"
            );
            assert!(started.elapsed() < Duration::from_secs(30), "{matched}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(held >= 64, "at least two blocks of 32 held: {held}");
        for _ in 0..2 {
            let again = routed(&cluster, &body).await;
            assert_eq!(word(&again, "prefill"), home, "{again}");
            assert_eq!(word(&again, "prefill_pick"), "kv_hit", "{again}");
            assert_eq!(
                word(&again, "prefill_cached_tokens"),
                held.to_string(),
                "{again}"
            );
        }
    }
    cluster.shutdown().await;
}
