//! NIXL P/D in sequential mode, and the check that the CPU adapter of the Mooncake connector
//! is still needed.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nixl_sequential_pd_through_the_proxy_equals_one_engine() {
    let _one = ONE_CLUSTER.lock().await;
    let (spec, _dir) = spec("real-nixl-", engines(Connector::Nixl).await);
    let cluster = start(&spec).await;
    let http = reqwest::Client::new();
    for (path, prompt) in [
        ("/v1/completions", LONG_PROMPT),
        ("/v1/chat/completions", SHORT_PROMPT),
    ] {
        for stream in [false, true] {
            let body = greedy(path, prompt, stream);
            let expected = reference(&http, &cluster.prefills[0], path, &body).await;
            let through = text(&http, &cluster.proxy.url, path, &body, "the proxy").await;
            assert_eq!(through, expected, "{path} {body}");
        }
    }
    let model = &spec.vllm.as_ref().unwrap().model;
    first_token::assert_first_token_answers_equal_one_engine(&cluster, model).await;
    cluster.shutdown().await;
}

/// The adapter exists for one line of vLLM: without it, vLLM's own MooncakeConnector must fail
/// on this host for exactly that reason. The day this test fails, vLLM fixed it: remove
/// `examples/vllm/cpu/pd_cpu_mooncake.py`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_still_needed_stock_mooncake_connector_fails_on_cpu() {
    let mut stock = engines(Connector::Mooncake).await;
    stock.mooncake_adapter = false;
    let run_dir = tempfile::Builder::new()
        .prefix("real-stock-")
        .tempdir()
        .unwrap();
    let mut engine = stock
        .spawn(
            run_dir.path(),
            "stock-decode",
            EngineRole::Decode,
            free_port(),
            None,
            free_port(),
            None,
        )
        .unwrap();
    let err = wait_ready(&mut engine)
        .await
        .expect_err("stock MooncakeConnector starts on CPU");
    let log = std::fs::read_to_string(&engine.log).unwrap();
    assert!(
        log.contains("self.device_id = torch.accelerator.current_device_index()"),
        "it failed for another reason: {err}"
    );
    engine.kill().await;
    assert!(Path::new(&format!("{}/pd_cpu_mooncake.py", vllm::CPU_DIR)).is_file());
}
