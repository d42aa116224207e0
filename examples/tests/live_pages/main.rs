//! The live pages (`GET /ui` of bootstrap-server and of pd-proxy) in a real browser: headless
//! Chromium over WebDriver (`browser.rs`). Each page loads with nothing on the console, follows
//! what happens within a second (a registration, a lease running out, a drain, requests and
//! their routing), shows an engine id made of HTML as text, and is photographed into the
//! target folder (`target/tmp/live-pages/*.png`).

mod browser;

use std::path::PathBuf;
use std::time::Duration;

use browser::Browser;
use pd_examples::cluster::{Cluster, ClusterSpec, PrefillShape};
use pd_examples::process::{free_port, spawn, wait_for, Process};
use serde_json::{json, Value};

const HTML_ID: &str = r#"<img src=x onerror="window.pwned=1">e1"#;

fn bin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf()
}

async fn post(url: String, body: Value) -> Value {
    let answer = reqwest::Client::new()
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(answer.status().is_success(), "{url}: {}", answer.status());
    answer.json().await.unwrap()
}

/// bootstrap-server on 127.0.0.1, expecting two dp ranks.
async fn registry(run_dir: &std::path::Path) -> (Process, String) {
    let port = free_port();
    let args: Vec<String> = [
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--dp-size",
        "2",
    ]
    .into_iter()
    .map(String::from)
    .chain([
        "--data-dir".into(),
        run_dir.join("db").display().to_string(),
    ])
    .collect();
    let url = format!("http://127.0.0.1:{port}");
    let program = bin_dir().join("bootstrap-server");
    let mut server = spawn(run_dir, "bootstrap", &program, &args, url.clone()).unwrap();
    wait_for(&mut server, "/health", Duration::from_secs(20))
        .await
        .unwrap();
    (server, url)
}

/// Whether the page's card `label` says `value`.
fn card(label: &str, value: &str) -> String {
    format!("document.querySelector('[data-card=\"{label}\"]')?.textContent === '{value}'")
}

/// The number of the engine sections the page shows for `id`.
fn engine_shown(id: &str) -> String {
    format!(
        "[...document.querySelectorAll('[data-engine]')].filter(e => e.dataset.engine === {}).length",
        serde_json::to_string(id).unwrap()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_page_follows_registrations_leases_and_drains() {
    let run_dir = tempfile::tempdir().unwrap();
    let (mut server, url) = registry(run_dir.path()).await;
    let browser = Browser::start().await;
    browser.open_live_page(&url).await;
    browser
        .until(
            "the empty registry",
            "document.body.innerText.includes('No worker is registered.')",
            Duration::from_secs(2),
        )
        .await;

    // A registration made now is on the page within a second.
    let register = |engine: &str, dp: u32, lease: Option<u32>| {
        let mut body = json!({"engine_id": engine, "dp_rank": dp, "tp_rank": 0, "pp_rank": 0,
                              "addr": format!("tcp://127.0.0.1:{}", 5000 + dp)});
        if let Some(ttl) = lease {
            body["lease_ttl"] = json!(ttl);
        }
        post(format!("{url}/register"), body)
    };
    register("e0", 0, None).await;
    let shown = browser
        .until(
            "e0 on the page",
            &format!("{} === 1", engine_shown("e0")),
            Duration::from_secs(1),
        )
        .await;
    println!("a registration was on the page {shown:?} after it was answered");

    // An engine id made of HTML is shown as text, not run; with it the topology is complete.
    let lease = register(HTML_ID, 1, Some(3)).await;
    browser
        .until(
            "the HTML engine id as text",
            &format!("{} === 1", engine_shown(HTML_ID)),
            Duration::from_secs(1),
        )
        .await;
    let injected = "document.querySelectorAll('main img').length > 0 || window.pwned === 1";
    let run: Value = browser
        .client
        .execute(&format!("return {injected};"), Vec::new())
        .await
        .unwrap();
    assert_eq!(run, json!(false), "the engine id was read as HTML");
    let text = browser.text_of("main", Duration::from_secs(1)).await;
    assert!(text.contains(HTML_ID), "{text}");
    assert!(
        !text.contains("null") && !text.contains("undefined"),
        "{text}"
    );
    browser
        .until(
            "the topology complete",
            &card("topology", "ready"),
            Duration::from_secs(1),
        )
        .await;

    // Its lease counts down on the page, then runs out: the worker goes, and says why.
    let left = "document.querySelector('[data-lease=\"live\"]')?.textContent ?? ''";
    browser
        .until(
            "the lease's countdown",
            &format!("{left}.includes('left of 3 s')"),
            Duration::from_secs(1),
        )
        .await;
    let before: Value = browser
        .client
        .execute(&format!("return {left};"), Vec::new())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let after: Value = browser
        .client
        .execute(&format!("return {left};"), Vec::new())
        .await
        .unwrap();
    assert_ne!(before, after, "the countdown does not move");
    // The lease id as the registry holds it, every digit (over 2^53, a number in JSON would
    // lose its last ones in the browser).
    let lease_id = lease["lease_id_str"].as_str().unwrap().to_owned();
    assert_eq!(lease_id, lease["lease_id"].as_i64().unwrap().to_string());
    assert!(
        after
            .as_str()
            .unwrap_or_default()
            .starts_with(&format!("{lease_id}: ")),
        "{after}"
    );
    browser
        .until(
            "the leased worker gone",
            &format!(
                "{} === 0 && document.body.innerText.includes('removed')",
                engine_shown(HTML_ID)
            ),
            Duration::from_secs(6),
        )
        .await;
    browser
        .until(
            "the topology not ready any more",
            &card("topology", "not ready"),
            Duration::from_secs(1),
        )
        .await;
    let workers = browser.text_of("[data-card=\"workers\"]", Duration::from_secs(1));
    assert_eq!(workers.await, "1 of 2");
    println!("lease {lease_id} ran out and the page said so");

    // A drain mark is on the page within a second.
    post(format!("{url}/engines/e0/drain"), json!({})).await;
    browser
        .until(
            "e0 draining",
            "document.querySelector('[data-draining]') !== null",
            Duration::from_secs(1),
        )
        .await;
    browser.finish("registry").await;
    server.stop(Duration::from_secs(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_page_shows_backends_routing_and_drains() {
    let run_dir = tempfile::tempdir().unwrap();
    let mut spec = ClusterSpec::demo(bin_dir(), run_dir.path().to_path_buf());
    spec.prefills = vec![PrefillShape { dp: 2, tp: 1 }];
    spec.decodes = 2;
    // With a key set, the page is served on the operator's own listener (a browser sends no
    // key); the clients' routes stay on the serving port.
    let admin_port = pd_examples::cluster::free_port();
    spec.proxy_args = ["--admin-key", "ui", "--admin-port", &admin_port.to_string()]
        .map(String::from)
        .to_vec();
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let url = cluster.proxy.url.clone();
    let admin = format!("http://127.0.0.1:{admin_port}");
    let browser = Browser::start().await;
    browser.open_live_page(&admin).await;
    browser
        .until(
            "every backend",
            "document.querySelectorAll('[data-backend]').length === 3",
            Duration::from_secs(2),
        )
        .await;
    browser
        .until(
            "ready",
            "document.querySelectorAll('[data-state=\"healthy\"]').length === 3",
            Duration::from_secs(2),
        )
        .await;

    // Requests: their routing decisions and outcomes appear.
    for _ in 0..4 {
        let body = json!({"model": "sim-model", "prompt": "shown on the page", "max_tokens": 2});
        post(format!("{url}/v1/completions"), body).await;
    }
    browser
        .until(
            "the decisions",
            "document.body.innerText.includes('disaggregated')",
            Duration::from_secs(3),
        )
        .await;
    let text = browser.text_of("main", Duration::from_secs(1)).await;
    assert!(text.contains("ok\t4") || text.contains("ok 4"), "{text}");
    assert!(text.contains("KV index"), "{text}");
    assert!(
        !text.contains("null") && !text.contains("undefined"),
        "{text}"
    );
    let ready = card("status", "ready");
    browser.until("ready", &ready, Duration::from_secs(1)).await;
    // The policy, and the last minutes charted from the snapshots (two points at least).
    let policy = card("policy", "round_robin");
    browser
        .until("the policy", &policy, Duration::from_secs(1))
        .await;
    for _ in 0..4 {
        let body = json!({"model": "sim-model", "prompt": "charted", "max_tokens": 2});
        post(format!("{url}/v1/completions"), body).await;
    }
    let charted = |title: &str| {
        format!(
            "(document.querySelector('[data-chart=\"{title}\"] polyline')?.getAttribute('points') \
             || '').split(' ').length >= 2"
        )
    };
    browser
        .until(
            "the requests chart",
            &charted("requests per second"),
            Duration::from_secs(4),
        )
        .await;
    browser
        .until(
            "the TTFT chart",
            &charted("time to first byte"),
            Duration::from_secs(4),
        )
        .await;

    // A drain at the proxy is on the page within a second or two (one snapshot a second).
    let decode = &cluster.decodes[0].url;
    let drained = reqwest::Client::new()
        .post(format!("{admin}/admin/drain"))
        .bearer_auth("ui")
        .json(&json!({"url": decode}))
        .send()
        .await
        .unwrap();
    assert!(drained.status().is_success());
    browser
        .until(
            "the decode drained",
            "document.querySelector('[data-state=\"drained\"]') !== null",
            Duration::from_secs(2),
        )
        .await;
    browser.finish("proxy").await;
    cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_page_shows_the_duty_of_each_engine_of_both_roles() {
    let run_dir = tempfile::tempdir().unwrap();
    let mut spec = ClusterSpec::demo(bin_dir(), run_dir.path().to_path_buf());
    spec.dual = true;
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; 2];
    spec.decodes = 0;
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let url = cluster.proxy.url.clone();
    let body = json!({"model": "sim-model", "prompt": "shown on the page", "max_tokens": 2});
    post(format!("{url}/v1/completions"), body).await;
    let browser = Browser::start().await;
    browser.open_live_page(&url).await;
    // The table after its heading: a row per engine, each on one duty.
    let table = "(() => { const title = [...document.querySelectorAll('h2')]\
                 .find((h) => h.innerText === 'Engines of both roles'); \
                 const rows = title ? [...title.nextElementSibling.querySelectorAll('tbody tr')] : []; \
                 return rows.length === 2 && rows.every((r) => \
                 ['prefill', 'decode'].includes(r.cells[1].innerText)); })()";
    browser
        .until(
            "the duties",
            "document.body.innerText.includes('Engines of both roles')",
            Duration::from_secs(3),
        )
        .await;
    browser
        .until("a row per engine", table, Duration::from_secs(2))
        .await;
    let text = browser.text_of("main", Duration::from_secs(1)).await;
    assert!(
        !text.contains("null") && !text.contains("undefined"),
        "{text}"
    );
    browser.finish("proxy-duals").await;
    cluster.shutdown().await;
}
