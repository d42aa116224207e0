//! Two real vLLM prefills that both register as dp_rank 0 (as every instance does under vLLM's
//! external or hybrid data-parallel load balancing) on one bootstrap-server with `--instance`:
//! one registers on the main port, the other on its instance's own port (a stock prefill names
//! a host and port, nothing more); pd-proxy names the second registry by its nested URL
//! (`/instances/b`), which vLLM's decode receives as `remote_bootstrap_addr` and asks
//! `/query` of. Both keep their slot, and every answer through each of them equals the engine's
//! own, its KV pulled by the decode.

use std::collections::BTreeMap;

use futures_util::future::try_join_all;
use pd_examples::cluster::wait_for;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_vllm_prefills_of_dp_rank_0_share_one_registry_through_instances() {
    let _one = ONE_CLUSTER.lock().await;
    let vllm = engines(Connector::Mooncake).await;
    let dir = tempfile::Builder::new()
        .prefix("real-instances-")
        .tempdir()
        .unwrap();
    let dir = dir.path();
    let b_port = free_port();
    let instance = format!("b={b_port}");
    let flags = ["--dp-size", "1", "--tp-size", "1", "--instance", &instance];
    let (mut registry, main) = bootstrap_server(dir, &flags);
    wait_for(&mut registry, "/health", Duration::from_secs(20))
        .await
        .unwrap();
    let own_port = format!("http://127.0.0.1:{b_port}");
    let nested = format!("{main}/instances/b");

    let spawn = |name: &str, role: EngineRole, registry: Option<&str>| {
        let port = free_port();
        (vllm.spawn(dir, name, role, port, registry, free_port(), None)).unwrap()
    };
    let mut p_a = spawn("prefill-a", EngineRole::Prefill, Some(&main));
    let mut p_b = spawn("prefill-b", EngineRole::Prefill, Some(&own_port));
    let mut decode = spawn("decode", EngineRole::Decode, None);
    try_join_all([&mut p_a, &mut p_b, &mut decode].map(wait_ready))
        .await
        .unwrap();
    for ready in ["/ready", "/instances/b/ready"] {
        wait_for(&mut registry, ready, Duration::from_secs(60))
            .await
            .unwrap();
    }

    // Each registry holds its own dp rank 0, the same on the instance's port and nested.
    let http = reqwest::Client::new();
    let in_a = json_of(http.get(format!("{main}/query"))).await;
    let in_b = json_of(http.get(format!("{nested}/query"))).await;
    assert_eq!(json_of(http.get(format!("{own_port}/query"))).await, in_b);
    let (engine_a, engine_b) = (&in_a["0"]["engine_id"], &in_b["0"]["engine_id"]);
    assert!(
        engine_a.is_string() && engine_b.is_string(),
        "{in_a} {in_b}"
    );
    assert_ne!(engine_a, engine_b, "two engines, one slot each");

    let proxy_port = free_port();
    let args = ["--host", "127.0.0.1", "--port", &proxy_port.to_string()];
    let fleet = ["--prefill", &p_a.url, &main, "--prefill", &p_b.url, &nested];
    let args: Vec<String> = (args.into_iter().chain(fleet))
        .chain(["--decode", &decode.url])
        .map(str::to_owned)
        .collect();
    let program = workspace_binary("pd-proxy");
    let proxy_url = format!("http://127.0.0.1:{proxy_port}");
    let mut proxy =
        pd_examples::cluster::spawn(dir, "proxy", &program, &args, proxy_url.clone()).unwrap();
    wait_for(&mut proxy, "/ready", Duration::from_secs(30))
        .await
        .unwrap();
    // Ready with one pair; each prefill's registry is read at its own first health check.
    let started = Instant::now();
    loop {
        let ready = json_of(http.get(format!("{proxy_url}/ready"))).await;
        if ready["ready_pairs"] == 2 {
            break;
        }
        let waited = started.elapsed();
        assert!(waited < Duration::from_secs(30), "both prefills: {ready}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Prompts that share no first block, so that D's prefix cache holds none of the next.
    let (pulled_before, _) = prompt_tokens_by_source(&decode).await;
    let mut by_prefill = BTreeMap::<String, usize>::new();
    let mut prompt_tokens = 0.0;
    for i in 0..8 {
        let body = greedy(
            "/v1/completions",
            &format!("Request {i}: {LONG_PROMPT}"),
            false,
        );
        let answer = http
            .post(format!("{proxy_url}/v1/completions"))
            .header("x-pd-route", "1")
            .json(&body)
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap();
        let route = answer.headers()["x-pd-route"].to_str().unwrap().to_owned();
        let status = answer.status();
        let through: Value = answer.json().await.unwrap();
        assert_eq!(status, 200, "{route}: {through}");
        let prefill = [&p_a.url, &p_b.url]
            .into_iter()
            .find(|url| route.contains(&format!("prefill={url}")))
            .unwrap_or_else(|| panic!("no known prefill in {route}"));
        *by_prefill.entry(prefill.clone()).or_default() += 1;
        let expected = reference(&http, &p_a, "/v1/completions", &body).await;
        assert_eq!(through["choices"][0]["text"], expected, "{route} {body}");
        prompt_tokens += token_count(&p_a, &body).await;
    }
    assert_eq!(by_prefill.len(), 2, "both prefills served: {by_prefill:?}");
    let (pulled, _) = prompt_tokens_by_source(&decode).await;
    assert!(
        pulled - pulled_before >= prompt_tokens - 8.0,
        "D pulled the KV of the prompts' {prompt_tokens} tokens (all but the last of each) from both prefills: \
         {pulled_before} -> {pulled}"
    );
    eprintln!(
        "answered through each prefill: {by_prefill:?}; D pulled {} tokens",
        pulled - pulled_before
    );
}
