//! The dashboards and alerting rules of `docs/` proven on a real Prometheus: a local cluster of
//! sim engines is scraped every second by a `prometheus` process, traffic goes through the
//! proxy, then every PromQL expression of `docs/grafana/*.json` must parse and return data, and
//! `docs/prometheus/pd-bootstrap-rules.yml` must load with every rule healthy. The rules are
//! also checked and unit-tested with `promtool`. The tools come from
//! `examples/prometheus/tools.sh` (Debian's `prometheus` package); without them these tests
//! fail, naming that script.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use pd_examples::cluster::{Cluster, ClusterSpec, PrefillShape};
use pd_examples::prometheus::{tools, Job, Prometheus};
use serde_json::{json, Value};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn promtool(args: &[&str], dir: &Path) {
    let output = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("promtool runs (examples/prometheus/tools.sh installs it)");
    assert!(
        output.status.success(),
        "promtool {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn promtool_checks_and_unit_tests_the_rules() {
    tools();
    let dir = repo().join("docs/prometheus");
    promtool(&["check", "rules", "pd-bootstrap-rules.yml"], &dir);
    promtool(&["test", "rules", "pd-bootstrap-rules.test.yml"], &dir);
}

/// Every `expr` of a Grafana dashboard, its variables replaced: `$__rate_interval` by 30s, the
/// template variables (`$route`, `${model}`...) by `.*`.
fn dashboard_exprs(file: &str) -> Vec<String> {
    let text = std::fs::read_to_string(repo().join("docs/grafana").join(file)).unwrap();
    let dashboard: Value = serde_json::from_str(&text).unwrap();
    fn collect(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (key, v) in map {
                    match (key.as_str(), v) {
                        ("expr", Value::String(expr)) => out.push(expr.clone()),
                        _ => collect(v, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|v| collect(v, out)),
            _ => {}
        }
    }
    let mut exprs = Vec::new();
    collect(&dashboard["panels"], &mut exprs);
    let variables: Vec<String> = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_owned())
        .collect();
    exprs
        .into_iter()
        .map(|expr| {
            let mut expr = expr.replace("$__rate_interval", "30s");
            for name in &variables {
                expr = expr
                    .replace(&format!("${{{name}}}"), ".*")
                    .replace(&format!("${name}"), ".*");
            }
            assert!(!expr.contains('$'), "a variable left in {expr}");
            expr
        })
        .collect()
}

/// The key of the proxy's one tenant (`--api-keys-file`): the tenants' panels have data.
const TENANT_KEY: &str = "sk-prometheus";

async fn traffic(proxy: &str, models: &[String], bootstrap: &str) {
    let mut headers = reqwest::header::HeaderMap::new();
    let bearer = format!("Bearer {TENANT_KEY}").parse().unwrap();
    headers.insert(reqwest::header::AUTHORIZATION, bearer);
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(20))
        .default_headers(headers)
        .build()
        .unwrap();
    for i in 0..12 {
        let body = json!({
            "model": models[0], "prompt": format!("prompt {i}"), "max_tokens": 3,
            "stream": i % 2 == 0,
        });
        let response = client
            .post(format!("{proxy}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
    // Failures a client causes: an unknown model (404), a body that is not JSON (400).
    let unknown = json!({"model": "no-such-model", "prompt": "x", "max_tokens": 1});
    let response = client
        .post(format!("{proxy}/v1/completions"))
        .json(&unknown)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    let response = client
        .post(format!("{proxy}/v1/completions"))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    // The bootstrap server's request lookups (a decode's question in a real deployment).
    let lookup = json!({"req_ids": ["no-such-request"], "tp_rank": 0, "tp_size": 1});
    client
        .post(format!("{bootstrap}/query_requests"))
        .json(&lookup)
        .send()
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboards_and_rules_work_on_a_real_prometheus() {
    tools();
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf();
    let run_dir = tempfile::Builder::new().prefix("prom-").tempdir().unwrap();
    let mut spec = ClusterSpec::demo(bin_dir, run_dir.path().to_path_buf());
    spec.prefills = vec![PrefillShape { dp: 2, tp: 1 }];
    spec.decodes = 1;
    spec.prefill_us_per_token = 10;
    spec.decode_ms_per_token = 1;
    // A tenant with limits (its panel has data); /metrics left open to the scrapes.
    let keys = run_dir.path().join("keys.toml");
    let tenant = format!("[tenants.prom]\nkeys = [\"{TENANT_KEY}\"]\nrequests_per_second = 1000\n");
    std::fs::write(&keys, tenant).unwrap();
    let keys = keys.display().to_string();
    spec.proxy_args
        .extend(["--api-keys-file".into(), keys, "--metrics-open".into()]);
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let proxy = cluster.proxy.url.clone();
    let bootstraps: Vec<String> = cluster.bootstraps.iter().map(|b| b.url.clone()).collect();
    let models: Vec<String> = cluster.models().iter().map(|m| m.name.clone()).collect();
    let rules = repo().join("docs/prometheus/pd-bootstrap-rules.yml");
    let jobs = [
        Job {
            name: "pd-proxy",
            targets: std::slice::from_ref(&proxy),
        },
        Job {
            name: "pd-bootstrap",
            targets: &bootstraps,
        },
    ];
    let prometheus = Prometheus::start(&jobs, Some(&rules));

    // Every target up, then traffic, then a few more scrapes.
    prometheus.wait_up(1 + bootstraps.len()).await;
    traffic(&proxy, &models, &bootstraps[0]).await;
    tokio::time::sleep(Duration::from_secs(4)).await;

    // Every dashboard expression parses and returns data (waiting for the scrapes to land):
    // none is excused: the traffic makes every series exist, and a counter that may never move
    // (retries) is queried `or vector(0)`, as series appear only once used.
    let mut exprs = dashboard_exprs("pd-proxy.json");
    let proxy_count = exprs.len();
    exprs.extend(dashboard_exprs("pd-bootstrap.json"));
    assert!(
        proxy_count > 10 && exprs.len() > proxy_count + 10,
        "{exprs:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut pending: Vec<String> = exprs.clone();
    loop {
        let mut still = Vec::new();
        for expr in &pending {
            let answer = prometheus.query(expr).await;
            assert_eq!(answer["status"], "success", "{expr}: {answer}");
            let empty = answer["data"]["result"]
                .as_array()
                .is_none_or(|r| r.is_empty());
            if empty {
                still.push(expr.clone());
            }
        }
        if still.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "dashboard expressions without data:\n{}",
            still.join("\n")
        );
        pending = still;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    // The rule file loaded, every rule evaluated without error.
    let rule_file = std::fs::read_to_string(repo().join("docs/prometheus/pd-bootstrap-rules.yml"));
    let expected = rule_file.unwrap().matches("- alert:").count();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let rules = prometheus.get("/api/v1/rules").await;
        assert_eq!(rules["status"], "success", "{rules}");
        let groups = rules["data"]["groups"].as_array().unwrap();
        let names: BTreeSet<&str> = groups.iter().map(|g| g["name"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            BTreeSet::from(["pd-bootstrap", "pd-proxy"]),
            "{rules}"
        );
        let unhealthy: Vec<&Value> = groups
            .iter()
            .flat_map(|g| g["rules"].as_array().unwrap())
            .filter(|r| r["health"] != "ok")
            .collect();
        let count: usize = groups
            .iter()
            .map(|g| g["rules"].as_array().unwrap().len())
            .sum();
        if unhealthy.is_empty() && count == expected {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "rules not all healthy ({count} loaded): {unhealthy:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    drop(prometheus);
    cluster.shutdown().await;
}
