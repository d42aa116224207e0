//! Real vLLM behind a real Envoy: pd-epp (ext_proc) picks the decode and names the prefill,
//! the pd-proxy sidecar beside the decode runs Mooncake P/D through it; every answer equals
//! the engine's own, and pd-epp followed the engines' KV events.

use super::*;
use pd_examples::cluster::gateway::envoy_binary;
use pd_examples::cluster::GatewaySpec;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_pd_through_envoy_equals_one_engine() {
    let _one = ONE_CLUSTER.lock().await;
    let mut engines = engines(Connector::Mooncake).await;
    engines.kv_events = true;
    let (mut spec, _dir) = spec("real-gateway-", engines);
    spec.gateway = Some(GatewaySpec {
        envoy: envoy_binary().unwrap_or_else(|err| panic!("Envoy: {err}")),
        fail_open: false,
        buffered: false,
        picker_timeout: Duration::from_secs(5),
        epp_args: ["--policy", "precise_prefix"].map(String::from).to_vec(),
    });
    let cluster = start(&spec).await;
    assert_pd_equals_one_engine(&cluster).await;
    let model = &spec.vllm.as_ref().unwrap().model;
    first_token::assert_first_token_answers_equal_one_engine(&cluster, model).await;
    let epp = &cluster.gateway.as_ref().unwrap().epp;
    let metrics = reqwest::get(format!("{}/metrics", epp.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let picks: f64 = (metrics.lines())
        .filter(|l| {
            l.starts_with("pd_epp_picks_total") && l.contains(r#"decision="disaggregated""#)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        picks >= 12.0,
        "pd-epp placed {picks} P/D requests:\n{metrics}"
    );
    let events: f64 = (metrics.lines())
        .filter(|l| l.starts_with("pd_epp_kv_events_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(events > 0.0, "pd-epp followed no KV event of the engines");
    cluster.shutdown().await;
}
