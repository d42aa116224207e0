//! pd-proxy's capacity planner on a real cluster of modelled sims (`--engine-model`): light
//! streamed traffic leaves two prefills more than enough (a scale-down waits its window),
//! heavy traffic asks for more prefills than there are, a frozen decode's silent metrics hold
//! the decodes' plan and say why, and flags that cannot work stop the proxy at start.

mod common;

use std::time::Duration;

use common::{binary, load, metric, planner_cluster};
use pd_examples::cluster::Cluster;
use serde_json::Value;

/// The live page's plan of `role` for the sims' model.
async fn plan(proxy: &str, role: &str) -> Value {
    let state: Value = reqwest::get(format!("{proxy}/ui/state"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let models = state["planner"].as_array().expect("the planner is on");
    let model = (models.iter())
        .find(|m| m["model"] == "sim-model")
        .unwrap_or_else(|| panic!("no plan for sim-model: {state}"));
    let roles = model["roles"].as_array().unwrap();
    let mut found = roles.iter().find(|r| r["role"] == role).unwrap().clone();
    found["requests_per_second"] = model["requests_per_second"].clone();
    found
}

#[tokio::test(flavor = "multi_thread")]
async fn the_planner_sizes_the_roles_on_the_load_and_holds_on_silent_metrics() {
    let (spec, _run_dir) = planner_cluster("planner-", 2, 2);
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let proxy = cluster.proxy.url.clone();

    // Light: 4 requests a second of 2,000 tokens (a 0.05 s prefill): one prefill would do,
    // but a scale-down waits its window (300 s), so two stay desired.
    load(&proxy, 4.0, 4.0, 2_000, 12).await;
    let prefill = plan(&proxy, "prefill").await;
    assert_eq!(prefill["held"], false, "{prefill}");
    assert_eq!(prefill["current"], 2, "{prefill}");
    assert_eq!(prefill["floor"], 1, "{prefill}");
    assert_eq!(prefill["desired"], 2, "{prefill}");
    assert_eq!(prefill["why"], "scale_down_pending", "{prefill}");
    assert!(
        prefill["engine_requests_per_second"].as_f64().unwrap() > 4.0,
        "{prefill}"
    );
    let decode = plan(&proxy, "decode").await;
    assert_eq!(decode["held"], false, "{decode}");
    let desired = r#"pd_proxy_planner_desired_engines{model="sim-model",role="prefill"}"#;
    assert_eq!(metric(&cluster.proxy, desired).await, 2.0);

    // Heavy: 20 requests a second of 8,000 tokens (0.23 s each): several prefills' worth.
    // Read while it lasts: once it is over, its window empties.
    let heavy = tokio::spawn({
        let proxy = proxy.clone();
        async move { load(&proxy, 20.0, 3.0, 8_000, 12).await }
    });
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let prefill = plan(&proxy, "prefill").await;
    heavy.await.unwrap();
    let desired = prefill["desired"].as_u64().unwrap();
    assert!(desired > 2, "{prefill}");
    assert!(
        ["floor", "burst"].contains(&prefill["why"].as_str().unwrap()),
        "{prefill}"
    );

    // A decode frozen: its metrics fall silent, the decodes' plan holds and says why.
    cluster.decodes[0].freeze(true);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Both read while it is frozen: once it answers again the hold ends at the next decision.
    let decode = plan(&proxy, "decode").await;
    let held = r#"pd_proxy_planner_held{model="sim-model",reason="stale_metrics",role="decode"}"#;
    let held = metric(&cluster.proxy, held).await;
    cluster.decodes[0].freeze(false);
    assert_eq!(decode["held"], true, "{decode}");
    assert_eq!(decode["why"], "stale_metrics", "{decode}");
    assert_eq!(held, 1.0);
}

#[test]
fn planner_flags_that_cannot_work_stop_the_proxy_naming_them() {
    let cases: [(&[&str], &str); 3] = [
        (&["--planner-ttft-target", "1"], "--planner-tpot-target"),
        (
            &["--planner-ttft-target", "1", "--planner-tpot-target", "0"],
            "--planner-tpot-target",
        ),
        (
            &[
                "--planner-ttft-target",
                "1",
                "--planner-tpot-target",
                "0.1",
                "--planner-min-engines",
                "4",
                "--planner-max-engines",
                "2",
            ],
            "--planner-max-engines",
        ),
    ];
    for (flags, named) in cases {
        let output = std::process::Command::new(binary("pd-proxy"))
            .args(["--port", "0", "--prefill", "http://127.0.0.1:9", "--decode"])
            .arg("http://127.0.0.1:9")
            .args(flags)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{flags:?}");
        assert!(stderr.contains(named), "{flags:?}: {stderr}");
    }
}
