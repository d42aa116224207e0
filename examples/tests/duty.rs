//! Engines of both roles (`--dual`: sim-engines playing vLLM's `kv_both`) behind pd-proxy
//! with its capacity planner: a prefill-heavy load moves them toward prefill duty and an
//! answer-heavy one moves them back, one engine at a time once its new direction is warmed
//! up; every answer is whole and none has its P and D on one engine; the split and each change
//! are on /metrics, the live page and in the log; pd-epp splits them the same. Flags that
//! cannot work stop the proxy.

mod common;

use std::future::Future;
use std::time::{Duration, Instant};

use common::{binary, load, metric, one_pair, planner_flags};
use pd_examples::cluster::{free_port, spawn, wait_for, Cluster, PrefillShape, Process};
use serde_json::Value;

/// The `--dual` engines on `duty`, as pd-proxy's /metrics says.
async fn on_duty(proxy: &Process, duty: &str) -> f64 {
    metric(proxy, &format!("pd_proxy_dual_engines{{duty=\"{duty}\"}}")).await
}

/// Waits up to `limit` for `check` to hold, reading `on_duty(prefill)`; the last value read.
async fn until<F, Fut>(proxy: &Process, limit: Duration, check: F) -> f64
where
    F: Fn(f64) -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        let prefills = on_duty(proxy, "prefill").await;
        if check(prefills).await || Instant::now() > deadline {
            return prefills;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The proxy's live page, as JSON: its plans and duals.
async fn state(proxy: &str) -> Value {
    let state: Value = reqwest::get(format!("{proxy}/ui/state"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    serde_json::json!({"planner": state["planner"], "duals": state["duals"]})
}

#[tokio::test(flavor = "multi_thread")]
async fn the_split_of_engines_of_both_roles_follows_the_load() {
    let (mut spec, _run_dir) = one_pair("duty-");
    spec.dual = true;
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; 4];
    spec.decodes = 0;
    let engine = [
        "--engine-model",
        "llama3-8b-h200",
        "--kv-bytes-per-token",
        "4",
    ];
    spec.engine_args = engine.map(String::from).to_vec();
    // Decodes of 4 answers at most at the TPOT target, so long answers need several; one
    // change a second at most; two of the four on prefill duty at start.
    spec.proxy_args = planner_flags();
    spec.proxy_args.extend(
        [
            "--planner-max-batch",
            "4",
            "--duty-dwell",
            "1",
            "--dual-prefills",
            "2",
        ]
        .map(String::from),
    );
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let proxy = cluster.proxy.url.clone();
    assert_eq!(on_duty(&cluster.proxy, "prefill").await, 2.0);
    assert_eq!(on_duty(&cluster.proxy, "decode").await, 2.0);

    // Light load first, for the latency models to learn: the needs are even, so is the split.
    load(&proxy, 4.0, 3.0, 2_000, 12).await;
    assert_eq!(on_duty(&cluster.proxy, "prefill").await, 2.0);

    // Prefill-heavy: 10 prompts a second of 8,000 tokens (0.23 s of prefill each) for 2-token
    // answers: the prefills need three or four engines, the decodes one.
    let heavy = tokio::spawn({
        let proxy = proxy.clone();
        async move { load(&proxy, 10.0, 8.0, 8_000, 2).await }
    });
    let wait = Duration::from_secs(8);
    let prefills = until(&cluster.proxy, wait, |n| async move { n >= 3.0 }).await;
    let seen = state(&proxy).await;
    heavy.await.unwrap();
    assert_eq!(
        prefills, 3.0,
        "the prefills' duty grew to 3 (every decode kept one): {seen}"
    );

    // Answer-heavy: 10 a second of 100-token prompts for 200-token answers: the decodes now
    // need as many engines as the prefills or more, and an engine goes back to decode duty.
    let long = tokio::spawn({
        let proxy = proxy.clone();
        async move { load(&proxy, 10.0, 10.0, 100, 200).await }
    });
    let wait = Duration::from_secs(10);
    let prefills = until(&cluster.proxy, wait, |n| async move { n <= 2.0 }).await;
    let seen = state(&proxy).await;
    long.await.unwrap();
    assert!(prefills <= 2.0, "the decodes' duty grew again: {seen}");

    // Every change warmed its direction first, and is counted.
    let counter = |name: &'static str| metric(&cluster.proxy, name);
    let to_prefill = r#"pd_proxy_duty_changes_total{duty="prefill",model="sim-model"}"#;
    let to_decode = r#"pd_proxy_duty_changes_total{duty="decode",model="sim-model"}"#;
    assert!(counter(to_prefill).await >= 1.0);
    assert!(counter(to_decode).await >= 1.0);
    let warmed = counter(r#"pd_proxy_duty_warmups_total{outcome="ok"}"#).await;
    assert!(warmed >= 2.0, "{warmed} warm-ups");
    let state = state(&proxy).await;
    let duals = state["duals"]
        .as_array()
        .expect("the live page shows the duals");
    assert_eq!(duals.len(), 4, "{state}");
    let prefill = duals.iter().filter(|d| d["duty"] == "prefill").count();
    assert_eq!(
        prefill as f64,
        on_duty(&cluster.proxy, "prefill").await,
        "{duals:?}"
    );
    let log = std::fs::read_to_string(&cluster.proxy.log).unwrap();
    assert!(log.contains("engine duty changed"), "{log}");
    cluster.shutdown().await;
}

#[test]
fn dual_flags_that_cannot_work_stop_the_proxy_naming_them() {
    let dual = |url: &'static str| ["--dual", url, "8998"];
    let cases: [(Vec<&str>, &str); 4] = [
        (
            dual("http://127.0.0.1:9").to_vec(),
            "one --dual engine alone",
        ),
        (
            [dual("http://127.0.0.1:9"), dual("http://127.0.0.1:10")].concat(),
            "",
        ),
        (
            [
                &dual("http://127.0.0.1:9")[..],
                &dual("http://127.0.0.1:10"),
                &["--mode", "sglang"],
            ]
            .concat(),
            "--dual needs --mode concurrent",
        ),
        (
            [
                &dual("http://127.0.0.1:9")[..],
                &dual("http://127.0.0.1:10"),
                &["--dual-prefills", "3"],
            ]
            .concat(),
            "--dual-prefills 3",
        ),
    ];
    let file = tempfile::NamedTempFile::new().unwrap();
    for (flags, named) in cases {
        let output = std::process::Command::new(binary("pd-proxy"))
            .arg("check-config")
            .arg(file.path())
            .args(&flags)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        // Two engines of both roles are a fleet: the configuration is accepted.
        assert_eq!(
            output.status.success(),
            named.is_empty(),
            "{flags:?}: {stderr}"
        );
        assert!(stderr.contains(named), "{flags:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn pd_epp_splits_engines_of_both_roles_too() {
    let dir = tempfile::tempdir().unwrap();
    let (grpc, admin) = (free_port(), free_port());
    let mut args: Vec<String> = ["--host", "127.0.0.1", "--dual-prefills", "1"]
        .map(String::from)
        .to_vec();
    args.extend(["--port".into(), grpc.to_string()]);
    args.extend(["--admin-port".into(), admin.to_string()]);
    for engine in [
        "http://127.0.0.1:9",
        "http://127.0.0.1:10",
        "http://127.0.0.1:11",
    ] {
        args.extend(["--dual".into(), engine.into(), "8998".into()]);
    }
    let url = format!("http://127.0.0.1:{admin}");
    let mut epp = spawn(dir.path(), "epp", &binary("pd-epp"), &args, url).unwrap();
    wait_for(&mut epp, "/health", Duration::from_secs(20))
        .await
        .unwrap();
    let split = |duty: &'static str| {
        let name = format!("pd_epp_dual_engines{{duty=\"{duty}\"}}");
        let epp = &epp;
        async move { metric(epp, &name).await }
    };
    assert_eq!(split("prefill").await, 1.0);
    assert_eq!(split("decode").await, 2.0);
    let duty = r#"pd_epp_engine_duty{backend="http://127.0.0.1:9",duty="prefill"}"#;
    assert_eq!(metric(&epp, duty).await, 1.0);
}
