//! pd-proxy as a gateway for two models on real sim-engine processes (vLLM's wire): model 0's
//! engines carry two LoRA adapters and allow loading more at run time. Each request lands on its
//! model's prefill and decode, an unknown model is a 404, a drained model a 503 naming it,
//! `GET /v1/models` is the union of the engines' cards, an adapter declared in `--config` is
//! loaded on demand on both sides, and the metrics carry the model.

use std::path::PathBuf;

use pd_examples::cluster::{Cluster, ClusterSpec, PrefillShape};
use serde_json::{json, Value};

const ADMIN_KEY: &str = "gateway-admin";

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(std::time::Duration::from_secs(20))
        .build()
        .unwrap()
}

/// Sends a completion for `model` asking for the route; returns the status, the `x-pd-route`
/// answer and the body.
async fn complete(proxy: &str, model: &str) -> (u16, String, Value) {
    let response = client()
        .post(format!("{proxy}/v1/completions"))
        .header("x-pd-route", "1")
        .json(&json!({"model": model, "prompt": "a gateway's prompt", "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let route = (response.headers().get("x-pd-route"))
        .map(|value| value.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, route, response.json().await.unwrap())
}

async fn get_json(url: &str) -> Value {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn ids(url: &str) -> Vec<String> {
    let list = get_json(&format!("{url}/v1/models")).await;
    let data = list["data"].as_array().unwrap();
    data.iter()
        .map(|card| card["id"].as_str().unwrap().to_owned())
        .collect()
}

async fn drain(proxy: &str, url: &str, draining: bool) {
    let response = client()
        .post(format!("{proxy}/admin/drain"))
        .bearer_auth(ADMIN_KEY)
        .json(&json!({"url": url, "draining": draining}))
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "{}", response.status());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_proxy_routes_two_models_and_their_adapters() {
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf();
    let run_dir = tempfile::Builder::new()
        .prefix("gateway-")
        .tempdir()
        .unwrap();
    let config = run_dir.path().join("pd-proxy.toml");
    std::fs::write(
        &config,
        format!(
            "admin-key = \"{ADMIN_KEY}\"\nlora-load-on-demand = true\n\
             health-check-interval = 0.2\n[aliases]\nsmall = \"sim-model-1\"\n\
             [adapters.sim-lora-c]\nbase = \"sim-model-0\"\npath = \"/adapters/c\"\n"
        ),
    )
    .unwrap();
    let mut spec = ClusterSpec::demo(bin_dir, run_dir.path().to_path_buf());
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
    spec.decodes = 1;
    spec.models = 2;
    spec.kv_events = false;
    spec.prefill_us_per_token = 10;
    spec.decode_ms_per_token = 1;
    spec.proxy_args = vec!["--config".into(), config.display().to_string()];
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let proxy = cluster.proxy.url.clone();
    let models = cluster.models().to_vec();

    // Each model (an adapter, an alias) on its own engines, P and D alike.
    for (asked, k) in [
        ("sim-model-0", 0),
        ("sim-model-1", 1),
        ("sim-lora-a", 0),
        ("small", 1),
        ("sim-lora-b", 0),
    ] {
        let (status, route, body) = complete(&proxy, asked).await;
        assert_eq!(status, 200, "{asked}: {body}");
        let served = &models[k];
        assert!(
            route.contains(&format!("prefill={};", served.prefills[0])),
            "{asked}: {route}"
        );
        assert!(
            route.contains(&format!("decode={}", served.decodes[0])),
            "{asked}: {route}"
        );
        let model = if asked == "small" {
            "sim-model-1"
        } else {
            asked
        };
        assert!(route.contains(&format!("model={model}")), "{route}");
        assert_eq!(body["model"], model, "D answered for {model}");
    }

    // The union of the engines' cards, adapters with their base.
    let list = get_json(&format!("{proxy}/v1/models")).await;
    let cards = list["data"].as_array().unwrap();
    let names: Vec<&str> = cards.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["sim-lora-a", "sim-lora-b", "sim-model-0", "sim-model-1"]
    );
    assert_eq!(cards[0]["parent"], "sim-model-0");
    assert_eq!(cards[0]["root"], "/adapters/a");
    assert_eq!(cards[3]["owned_by"], "vllm");
    assert!(cards[3]["max_model_len"].as_u64().unwrap() > 0);

    // A model nobody serves.
    let (status, _, body) = complete(&proxy, "sim-model-9").await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("sim-model-1"),
        "{body}"
    );

    // An adapter no engine has: loaded on model 0's prefill and decode, then served there.
    let (status, route, body) = complete(&proxy, "sim-lora-c").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        route.contains(&format!("decode={}", models[0].decodes[0])),
        "{route}"
    );
    for engine in [&models[0].prefills[0], &models[0].decodes[0]] {
        assert!(
            ids(engine).await.contains(&"sim-lora-c".to_owned()),
            "{engine}"
        );
    }
    assert!(!ids(&models[1].decodes[0])
        .await
        .contains(&"sim-lora-c".to_owned()));

    // Model 1's decode drained at the proxy: its requests are a 503 naming it; model 0 goes on.
    drain(&proxy, &models[1].decodes[0], true).await;
    let (status, _, body) = complete(&proxy, "sim-model-1").await;
    assert_eq!(status, 503, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("sim-model-1") && message.contains("decode"),
        "{message}"
    );
    assert_eq!(complete(&proxy, "sim-model-0").await.0, 200);
    drain(&proxy, &models[1].decodes[0], false).await;
    assert_eq!(complete(&proxy, "sim-model-1").await.0, 200);

    // The metrics by model.
    let metrics = client()
        .get(format!("{proxy}/metrics"))
        .bearer_auth(ADMIN_KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let count = |labels: &str| -> f64 {
        (metrics.lines())
            .filter(|line| line.starts_with("pd_proxy_requests_total{") && line.contains(labels))
            .map(|line| line.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
            .sum()
    };
    assert_eq!(count(r#"model="sim-model-1",outcome="ok""#), 3.0);
    assert_eq!(count(r#"model="sim-model-1",outcome="unavailable""#), 1.0);
    assert_eq!(count(r#"model="sim-lora-c",outcome="ok""#), 1.0);
    assert_eq!(count(r#"model="other",outcome="model_not_found""#), 1.0);
    let loads = r#"pd_proxy_lora_loads_total{outcome="loaded",role="decode"} 1"#;
    assert!(metrics.contains(loads), "{metrics}");
    cluster.shutdown().await;
}

/// Sends `prompt` to `model` and returns the `x-pd-route` answer.
async fn route_of(proxy: &str, model: &str, prompt: &str) -> String {
    let response = client()
        .post(format!("{proxy}/v1/completions"))
        .header("x-pd-route", "1")
        .json(&json!({"model": model, "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let route = response.headers()["x-pd-route"]
        .to_str()
        .unwrap()
        .to_owned();
    route
}

fn word<'r>(route: &'r str, key: &str) -> &'r str {
    let start = route
        .find(&format!("{key}="))
        .unwrap_or_else(|| panic!("{key}: {route}"));
    route[start + key.len() + 1..].split(';').next().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_cached_blocks_are_its_own_to_precise_prefix() {
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf();
    let run_dir = tempfile::Builder::new()
        .prefix("gateway-kv-")
        .tempdir()
        .unwrap();
    let mut spec = ClusterSpec::demo(bin_dir, run_dir.path().to_path_buf());
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; 2];
    spec.decodes = 1;
    spec.models = 2;
    spec.prefill_us_per_token = 10;
    spec.decode_ms_per_token = 1;
    spec.proxy_args = ["--policy", "precise_prefix"].map(String::from).to_vec();
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let proxy = cluster.proxy.url.clone();
    let prompt = "an adapter's long prompt, repeated until it fills several blocks. ".repeat(4);

    let first = route_of(&proxy, "sim-lora-a", &prompt).await;
    assert_eq!(word(&first, "prefill_pick"), "kv_miss", "{first}");
    let holder = word(&first, "prefill").to_owned();
    // Once the prefill's events are in, the same prompt goes back to it, on the adapter's
    // blocks; the base model's request for the same text holds none of them.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let again = loop {
        let route = route_of(&proxy, "sim-lora-a", &prompt).await;
        if word(&route, "prefill_pick") == "kv_hit" {
            break route;
        }
        assert!(std::time::Instant::now() < deadline, "never a hit: {route}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!(word(&again, "prefill"), holder, "{again}");
    assert!(
        word(&again, "prefill_cached_tokens")
            .parse::<usize>()
            .unwrap()
            >= 64
    );
    let base = route_of(&proxy, "sim-model-0", &prompt).await;
    assert_eq!(word(&base, "prefill_pick"), "kv_miss", "{base}");
    assert_eq!(word(&base, "prefill_cached_tokens"), "0", "{base}");
    cluster.shutdown().await;
}
