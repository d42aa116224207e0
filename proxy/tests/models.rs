//! One proxy, two models (one with a LoRA adapter): each request lands on its model's P and D,
//! unknown models are 404 `model_not_found`, a model whose engines are down is a 503 naming it,
//! `GET /v1/models` is the union, adapters are loaded on demand (never on half a pair), aliases
//! rewrite the body, and the metrics carry the model.

mod common;

use std::time::Duration;

use common::*;
use pd_proxy::config::AdapterSource;
use pd_proxy::ProxyHandle;
use serde_json::{json, Value};

/// Two models behind one proxy: `alpha` (adapter `alpha-sql` loaded) and `beta`, each with a
/// prefill (and its bootstrap server) and a decode.
struct Gateway {
    alpha: (Mock, Mock),
    beta: (Mock, Mock),
    _bootstraps: (Bootstrap, Bootstrap),
    proxy: ProxyHandle,
}

impl Gateway {
    async fn start(edit: impl FnOnce(&mut pd_proxy::Config)) -> Self {
        let engines = |model: &'static str, adapters: &'static [&'static str]| async move {
            let (prefill, decode) = (Mock::prefill().await, Mock::decode().await);
            prefill.set_models(model, adapters);
            decode.set_models(model, adapters);
            (prefill, decode)
        };
        let alpha = engines("alpha", &["alpha-sql"]).await;
        let beta = engines("beta", &[]).await;
        let bootstraps = (
            Bootstrap::start(topology(&[(0, "engine-a")])).await,
            Bootstrap::start(topology(&[(0, "engine-b")])).await,
        );
        let mut config = config(
            vec![
                target(&alpha.0, &bootstraps.0.url()),
                target(&beta.0, &bootstraps.1.url()),
            ],
            vec![alpha.1.url(), beta.1.url()],
        );
        config.router.health.interval = Duration::from_millis(100);
        edit(&mut config);
        let proxy = start_proxy(config).await;
        wait_ready(&proxy).await;
        let gateway = Gateway {
            alpha,
            beta,
            _bootstraps: bootstraps,
            proxy,
        };
        gateway.wait_models(3).await;
        gateway
    }

    async fn wait_models(&self, n: usize) -> Value {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let list = get_json(&self.proxy, "/v1/models").await;
            if list["data"].as_array().is_some_and(|data| data.len() == n) {
                return list;
            }
            assert!(std::time::Instant::now() < deadline, "models: {list}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn complete(&self, model: &str) -> (u16, Value) {
        let response = client()
            .post(format!("{}/v1/completions", self.proxy.url()))
            .json(&json!({"model": model, "prompt": "hi", "max_tokens": 3}))
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }
}

fn models_seen(mock: &Mock) -> Vec<String> {
    mock.seen()
        .iter()
        .map(|seen| seen.body["model"].as_str().unwrap_or("").to_owned())
        .collect()
}

#[tokio::test]
async fn each_request_lands_on_its_models_prefill_and_decode() {
    let gateway = Gateway::start(|_| {}).await;
    for model in ["alpha", "beta", "alpha-sql", "beta", "alpha"] {
        assert_eq!(gateway.complete(model).await.0, 200, "{model}");
    }
    assert_eq!(
        models_seen(&gateway.alpha.0),
        ["alpha", "alpha-sql", "alpha"]
    );
    assert_eq!(
        models_seen(&gateway.alpha.1),
        ["alpha", "alpha-sql", "alpha"]
    );
    assert_eq!(models_seen(&gateway.beta.0), ["beta", "beta"]);
    assert_eq!(models_seen(&gateway.beta.1), ["beta", "beta"]);

    // The union, each card as its engine sent it.
    let list = gateway.wait_models(3).await;
    assert_eq!(list["object"], "list");
    let ids: Vec<&str> = (list["data"].as_array().unwrap().iter())
        .map(|card| card["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["alpha", "alpha-sql", "beta"]);
    assert_eq!(list["data"][1]["parent"], "alpha");
    assert_eq!(list["data"][1]["root"], "/adapters/alpha-sql");
    assert_eq!(list["data"][0]["max_model_len"], 4096);
    assert_eq!(list["data"][0]["owned_by"], "vllm");

    // Requests and decisions by model; names nobody serves count as `other`.
    assert_eq!(gateway.complete("gamma").await.0, 404);
    let metrics = metrics(&gateway.proxy).await;
    let requests = |labels: &str| sample(&metrics, "pd_proxy_requests_total", labels);
    assert_eq!(requests(r#"model="alpha",outcome="ok""#), 2.0);
    assert_eq!(requests(r#"model="alpha-sql",outcome="ok""#), 1.0);
    assert_eq!(requests(r#"model="beta",outcome="ok""#), 2.0);
    assert_eq!(requests(r#"model="other",outcome="model_not_found""#), 1.0);
    assert!(
        !metrics.contains("gamma"),
        "an unserved name is not a label"
    );
    let decisions = sample(
        &metrics,
        "pd_proxy_route_decisions_total",
        r#"decision="disaggregated",model="beta""#,
    );
    assert_eq!(decisions, 2.0);
    assert!(
        sample(
            &metrics,
            "pd_proxy_time_to_first_byte_seconds_count",
            r#"model="beta""#
        ) >= 2.0
    );
}

#[tokio::test]
async fn unknown_models_are_404_and_down_models_503() {
    let gateway = Gateway::start(|_| {}).await;
    let (status, body) = gateway.complete("gamma").await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "model_not_found");
    assert_eq!(body["error"]["param"], "model");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("`gamma`") && message.contains("alpha, alpha-sql, beta"),
        "{message}"
    );

    // beta's decode goes down: beta is served here but unavailable; alpha still works.
    gateway.beta.1.set_healthy(false);
    wait_metrics(&gateway.proxy, "beta's decode out", |m| {
        sample(
            m,
            "pd_proxy_backend_healthy",
            &format!("backend=\"{}\"", gateway.beta.1.url()),
        ) == 0.0
    })
    .await;
    let (status, body) = gateway.complete("beta").await;
    assert_eq!(status, 503, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("`beta`") && message.contains("decode"),
        "{message}"
    );
    assert_eq!(gateway.complete("alpha").await.0, 200);
    // The union lists healthy engines' models; beta's prefill still serves it.
    assert_eq!(gateway.wait_models(3).await["data"][2]["id"], "beta");
}

/// `--lora-load-on-demand`, with adapter `alpha-new` of `alpha` in the configuration.
fn allow_loading_alpha_new(config: &mut pd_proxy::Config) {
    config.router.models.load_on_demand = true;
    let source = AdapterSource {
        base: "alpha".into(),
        path: "/adapters/new".into(),
    };
    config
        .router
        .models
        .adapters
        .insert("alpha-new".into(), source);
}

#[tokio::test]
async fn adapters_are_loaded_on_demand_on_both_sides_once() {
    let gateway = Gateway::start(allow_loading_alpha_new).await;
    for mock in [&gateway.alpha.0, &gateway.alpha.1] {
        mock.state
            .lora_updating
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
    let (first, second) =
        tokio::join!(gateway.complete("alpha-new"), gateway.complete("alpha-new"));
    assert_eq!((first.0, second.0), (200, 200));
    for mock in [&gateway.alpha.0, &gateway.alpha.1] {
        let loads = mock.state.lora_loads.lock().unwrap().clone();
        assert_eq!(
            loads,
            [json!({"lora_name": "alpha-new", "lora_path": "/adapters/new"})]
        );
    }
    assert_eq!(models_seen(&gateway.alpha.1), ["alpha-new", "alpha-new"]);
    assert!(gateway.beta.1.seen().is_empty());
    let metrics = metrics(&gateway.proxy).await;
    let loads = |role: &str| {
        let labels = format!("outcome=\"loaded\",role=\"{role}\"");
        sample(&metrics, "pd_proxy_lora_loads_total", &labels)
    };
    assert_eq!((loads("prefill"), loads("decode")), (1.0, 1.0));
    // An adapter both sides list already needs no load.
    assert_eq!(gateway.complete("alpha-sql").await.0, 200);
    let after = common::metrics(&gateway.proxy).await;
    assert_eq!(sample(&after, "pd_proxy_lora_loads_total", ""), 2.0);
}

#[tokio::test]
async fn an_adapter_one_side_cannot_load_is_never_half_served() {
    let gateway = Gateway::start(allow_loading_alpha_new).await;
    // Only the prefill allows runtime loading: the decode's route does not exist (vLLM's
    // guard), so no pair has the adapter on both sides.
    (gateway.alpha.0.state.lora_updating).store(true, std::sync::atomic::Ordering::SeqCst);
    let (status, body) = gateway.complete("alpha-new").await;
    assert_eq!(status, 503, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("alpha-new") && message.contains("404"),
        "{message}"
    );
    assert!(
        models_seen(&gateway.alpha.0).is_empty(),
        "P was never called"
    );
    assert!(
        models_seen(&gateway.alpha.1).is_empty(),
        "D was never called"
    );
    let metrics = metrics(&gateway.proxy).await;
    let failed = r#"outcome="failed",role="decode""#;
    assert_eq!(sample(&metrics, "pd_proxy_lora_loads_total", failed), 1.0);
}

#[tokio::test]
async fn aliases_and_per_model_policies_come_from_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pd-proxy.toml");
    std::fs::write(
        &file,
        "policy = \"least_loaded\"\n[aliases]\n\"gpt-4o-mini\" = \"beta\"\n\
         [models.alpha]\nprefill-policy = \"cache_aware\"\n",
    )
    .unwrap();
    let argv = [
        "pd-proxy",
        "--config",
        file.to_str().unwrap(),
        "--prefill",
        "http://p:1",
    ];
    let args =
        pd_proxy::config::Args::try_parse_args(argv.iter().chain(&["--decode", "http://d:2"]))
            .unwrap();
    let models = args.into_config(None).unwrap().router.models;
    let gateway = Gateway::start(|config| config.router.models = models).await;
    assert_eq!(gateway.complete("gpt-4o-mini").await.0, 200);
    // P and D are sent the model the alias stands for.
    assert_eq!(models_seen(&gateway.beta.0), ["beta"]);
    assert_eq!(models_seen(&gateway.beta.1), ["beta"]);
    let metrics = metrics(&gateway.proxy).await;
    assert_eq!(
        sample(
            &metrics,
            "pd_proxy_requests_total",
            r#"model="beta",outcome="ok""#
        ),
        1.0
    );
}
