//! Sequential mode with stock NIXL prefills: a prefill given without a bootstrap port has no
//! bootstrap server, and is used as dp rank 0 as soon as its `/health` passes.

mod common;

use std::time::{Duration, Instant};

use common::*;
use pd_proxy::config::{parse_prefill, Mode};
use serde_json::json;

#[tokio::test]
async fn a_prefill_without_a_bootstrap_server_is_used_once_its_health_passes() {
    let prefill = Mock::prefill().await;
    prefill.set_healthy(false);
    let decode = Mock::decode().await;
    // What `--mode sequential --prefill URL` (or `URL none`) configures.
    let target = parse_prefill(
        &prefill.url(),
        None,
        Mode::Sequential.default_bootstrap_port(),
    )
    .unwrap();
    assert_eq!(target.bootstrap_addr, None);
    let mut config = config(vec![target], vec![decode.url()]);
    config.router.mode = Mode::Sequential;
    let proxy = start_proxy(config).await;

    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ready_status(&proxy).await, 503, "ready before P's /health");
    prefill.set_healthy(true);
    let healthy = Instant::now();
    wait_ready(&proxy).await;
    assert!(
        healthy.elapsed() < Duration::from_secs(1),
        "{:?}",
        healthy.elapsed()
    );
    let ready = get_json(&proxy, "/ready").await;
    assert_eq!(
        ready["prefills"][0]["bootstrap_addr"],
        json!(null),
        "{ready}"
    );
    assert_eq!(
        ready["prefills"][0]["dp_ranks"],
        json!({"0": null}),
        "{ready}"
    );

    assert_eq!(complete_status(&proxy).await, 200);
    let p = prefill.wait_seen(1).await.remove(0);
    assert_eq!(p.header("x-data-parallel-rank").as_deref(), Some("0"));
    let d = decode.wait_seen(1).await.remove(0);
    assert_eq!(
        d.body["kv_transfer_params"],
        prefill_answer()["kv_transfer_params"],
        "D gets what P answered"
    );
    proxy.shutdown().await.unwrap();
}
