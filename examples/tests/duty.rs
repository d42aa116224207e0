//! Engines of both roles (`--dual`: sim-engines playing vLLM's `kv_both`) behind pd-proxy
//! with its capacity planner: a prefill-heavy load moves them toward prefill duty and an
//! answer-heavy one moves them back, one engine at a time once its new direction is warmed
//! up; every answer is whole and none has its P and D on one engine; the split and each change
//! are on /metrics, the live page and in the log; pd-epp splits them the same. Flags that
//! cannot work stop the proxy.

mod common;

use std::future::Future;
use std::time::{Duration, Instant};

use common::{binary, load, metric, one_pair, planner_cluster};
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
    let (mut spec, _run_dir) = planner_cluster("duty-", 4, 0);
    spec.dual = true;
    // Decodes of 4 answers at most at the TPOT target, so long answers need several; one
    // change a second at most; two of the four on prefill duty at start.
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
    let flags = [
        "--host",
        "127.0.0.1",
        "--dual-prefills",
        "1",
        "--admin-key",
        "admin",
    ];
    let mut args: Vec<String> = flags.map(String::from).to_vec();
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
    // Its operator's route: these engines answer nothing, so a swap's warm-up fails and no
    // duty changes; an engine it does not have is named.
    let swap =
        serde_json::json!({"http://127.0.0.1:9": "decode", "http://127.0.0.1:10": "prefill"});
    let (status, answer) = set_duties(&epp.url, swap).await;
    assert_eq!(status, 502, "{answer}");
    assert!(answer.to_string().contains("warm-up"), "{answer}");
    assert_eq!(metric(&epp, duty).await, 1.0);
    let unknown = serde_json::json!({"http://127.0.0.1:12": "decode"});
    assert_eq!(set_duties(&epp.url, unknown).await.0, 404);
}

/// POSTs `duties` to the proxy's `/admin/duties` with the admin key: the status and answer.
async fn set_duties(proxy: &str, duties: Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("{proxy}/admin/duties"))
        .bearer_auth("admin")
        .json(&serde_json::json!({ "duties": duties }))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_swaps_two_engines_duties_under_load() {
    let (mut spec, _run_dir) = one_pair("duty-swap-");
    spec.dual = true;
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; 2];
    spec.decodes = 0;
    spec.proxy_args = ["--admin-key", "admin", "--metrics-open"]
        .map(String::from)
        .to_vec();
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let proxy = cluster.proxy.url.clone();
    let (a, b) = (
        cluster.prefills[0].url.clone(),
        cluster.prefills[1].url.clone(),
    );
    // A steady load the whole time: every answer whole, none with P and D on one engine.
    let steady = tokio::spawn({
        let proxy = proxy.clone();
        async move { load(&proxy, 20.0, 4.0, 200, 8).await }
    });
    let mut swaps = Vec::new();
    for round in 0..4 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        let (to_a, to_b) = match round % 2 {
            0 => ("decode", "prefill"),
            _ => ("prefill", "decode"),
        };
        let (status, answer) = set_duties(&proxy, serde_json::json!({&a: to_a, &b: to_b})).await;
        assert_eq!(status, 200, "{answer}");
        let duty_of = |url: &str| {
            let duals = answer["duals"].as_array().unwrap();
            let dual = duals.iter().find(|d| d["url"] == url).unwrap();
            dual["duty"].as_str().unwrap().to_owned()
        };
        assert_eq!((duty_of(&a), duty_of(&b)), (to_a.into(), to_b.into()));
        swaps.push(round);
    }
    steady.await.unwrap();
    assert_eq!(swaps.len(), 4);
    let warmed = r#"pd_proxy_duty_warmups_total{outcome="ok"}"#;
    assert_eq!(
        metric(&cluster.proxy, warmed).await,
        8.0,
        "a warm-up per engine moved"
    );

    // Refusals that change nothing: an engine that is not one of both roles, a split with no
    // prefill, a body without `duties`.
    let (status, answer) =
        set_duties(&proxy, serde_json::json!({"http://127.0.0.1:9": "decode"})).await;
    assert_eq!(status, 404, "{answer}");
    assert!(
        answer.to_string().contains("not an engine of both roles"),
        "{answer}"
    );
    let (status, answer) =
        set_duties(&proxy, serde_json::json!({&a: "decode", &b: "decode"})).await;
    assert_eq!(status, 409, "{answer}");
    assert!(
        answer
            .to_string()
            .contains("no engine would be left on prefill"),
        "{answer}"
    );
    let bad = reqwest::Client::new()
        .post(format!("{proxy}/admin/duties"))
        .bearer_auth("admin")
        .json(&serde_json::json!({"duty": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    assert_eq!(on_duty(&cluster.proxy, "prefill").await, 1.0);
    cluster.shutdown().await;
}
