//! Mooncake P/D through the proxy: equal answers, the KV pulled, the KV events indexed, one
//! trace from the client through the proxy into both engines, an unknown engine refused at
//! once, a killed and restarted P followed.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_pd_through_the_proxy_equals_one_engine() {
    let _one = ONE_CLUSTER.lock().await;
    let receiver = OtlpReceiver::start().await.unwrap();
    let mut engines = engines(Connector::Mooncake).await;
    engines.kv_events = true;
    engines.otlp_traces = Some(format!("{}/v1/traces", receiver.url));
    let (mut spec, _dir) = spec("real-mooncake-", engines);
    spec.proxy_args = ["--admin-key", "admin"].map(String::from).to_vec();
    spec.proxy_env = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), receiver.url.clone()),
        ("OTEL_BSP_SCHEDULE_DELAY".into(), "100".into()),
    ];
    let mut cluster = start(&spec).await;
    let first_engine = registered_engine(&cluster.bootstraps[0]).await;

    assert_pd_equals_one_engine(&cluster).await;
    let model = &spec.vllm.as_ref().unwrap().model;
    first_token::assert_first_token_answers_equal_one_engine(&cluster, model).await;
    assert_one_trace_through_both_engines(&cluster, &receiver).await;

    // Both engines' KV cache events reached the proxy's index: P's blocks of the prompts it
    // computed, D's of the KV it pulled.
    let kv_index = wait_kv_index(&cluster, |engines| {
        engines.len() == 2
            && engines
                .iter()
                .all(|e| e["connected"] == true && e["blocks"].as_u64() > Some(0))
    })
    .await;
    for engine in kv_index["engines"].as_array().unwrap() {
        assert_eq!(engine["malformed"], 0, "{kv_index}");
    }

    // D took the prompt's KV from P and computed none of it.
    let http = reqwest::Client::new();
    let (pulled_before, computed_before) = prompt_tokens_by_source(&cluster.decodes[0]).await;
    // A prompt no engine has seen from its first block on: nothing of it is in D's prefix cache.
    let body = greedy(
        "/v1/completions",
        &format!("Once more: {LONG_PROMPT}"),
        false,
    );
    let answer = through_proxy(&cluster, &body).await;
    assert_eq!(answer.status, 200, "{}", answer.text);
    let (pulled, computed) = prompt_tokens_by_source(&cluster.decodes[0]).await;
    let prompt_tokens = token_count(&cluster.prefills[0], &body).await;
    assert!(
        prompt_tokens > 64.0,
        "the prompt spans several blocks: {prompt_tokens} tokens"
    );
    assert!(
        pulled - pulled_before >= prompt_tokens - 1.0 && computed - computed_before <= 1.0,
        "D pulled the KV of the prompt's {prompt_tokens} tokens and computed at most the last: \
         pulled {pulled_before} -> {pulled}, computed {computed_before} -> {computed}"
    );

    // A D asked for an engine nobody registered fails cleanly and at once, and serves on. Its
    // answer is what pd-proxy's unknown-engine check expects of vLLM 0.32 (and what its mock D
    // in proxy/tests plays): a generic 500 whole, a 200 whose first event is that error streamed.
    for stream in [false, true] {
        let unknown = json!({"model": vllm::TINY_MODEL_NAME, "prompt": SHORT_PROMPT,
            "max_tokens": 4, "stream": stream,
            "kv_transfer_params": {"do_remote_decode": false, "do_remote_prefill": true,
                "remote_bootstrap_addr": cluster.bootstraps[0].url,
                "remote_engine_id": "nobody-registered", "transfer_id": format!("xfer-nobody-{stream}")}});
        let started = Instant::now();
        let refused = http
            .post(format!("{}/v1/completions", cluster.decodes[0].url))
            .json(&unknown)
            .timeout(Duration::from_secs(60))
            .send()
            .await
            .unwrap();
        let status = refused.status().as_u16();
        let text = refused.text().await.unwrap();
        let error = r#"{"error":{"message":"Internal server error","type":"InternalServerError","#;
        match stream {
            false => assert!(status == 500 && text.starts_with(error), "{status} {text}"),
            true => assert!(
                status == 200
                    && text
                        .replace(": ", ":")
                        .replace(", ", ",")
                        .starts_with(&format!("data:{error}")),
                "{status} {text}"
            ),
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "at once: {:?}",
            started.elapsed()
        );
    }

    // P restarted under a new engine id: the registry takes it over under default flags, the
    // proxy follows within seconds of its /health, and the answers stay equal.
    let prefill_port: u16 = cluster.prefills[0]
        .url
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    // P's API server dies alone, as when the launcher is killed: its engine core and worker
    // (other processes, started by vLLM) die with it (examples/vllm/cpu/sitecustomize.py).
    let leader = cluster.prefills[0].pid().unwrap() as i32;
    let members: Vec<i32> = group_members(leader)
        .into_iter()
        .filter(|pid| *pid != leader)
        .collect();
    assert!(
        members.len() >= 2,
        "vLLM's engine core and worker: {members:?}"
    );
    // SAFETY: kill(2) with a pid this test's cluster started and a valid signal.
    unsafe { libc::kill(leader, libc::SIGKILL) };
    let killed = Instant::now();
    while members
        .iter()
        .any(|pid| Path::new(&format!("/proc/{pid}")).exists())
    {
        assert!(
            killed.elapsed() < Duration::from_secs(15),
            "vLLM's processes {members:?} outlived their API server"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.prefills[0].kill().await;
    let vllm = spec.vllm.as_ref().unwrap();
    let bootstrap = cluster.bootstraps[0].url.clone();
    let mut restarted = vllm
        .spawn(
            &spec.run_dir,
            "prefill-0-restarted",
            EngineRole::Prefill,
            prefill_port,
            Some(&bootstrap),
            free_port(),
            None,
        )
        .unwrap();
    wait_ready(&mut restarted)
        .await
        .unwrap_or_else(|err| panic!("{err}"));
    let healthy_at = Instant::now();
    cluster.prefills[0] = restarted;
    let body = greedy("/v1/completions", LONG_PROMPT, false);
    let through = loop {
        let answer = through_proxy(&cluster, &body).await;
        if answer.status == 200 {
            break answer.text;
        }
        assert!(
            healthy_at.elapsed() < Duration::from_secs(30),
            "the proxy did not follow the restart: {} {}",
            answer.status,
            answer.text
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let followed_in = healthy_at.elapsed();
    eprintln!("the proxy served through the restarted P {followed_in:?} after its /health");
    assert!(
        followed_in < Duration::from_secs(5),
        "the proxy followed the restart in {followed_in:?}"
    );
    let second_engine = registered_engine(&cluster.bootstraps[0]).await;
    assert_ne!(
        first_engine, second_engine,
        "the restarted P registered under a new engine id"
    );
    assert_eq!(
        through,
        reference(&http, &cluster.prefills[0], "/v1/completions", &body).await
    );
    assert_pd_equals_one_engine(&cluster).await;
    cluster.shutdown().await;
}

/// A client's trace through the proxy into P and D: vLLM's own request spans are children of
/// the proxy's `prefill` and `decode` spans, in the client's trace.
async fn assert_one_trace_through_both_engines(cluster: &Cluster, receiver: &OtlpReceiver) {
    let trace = "5bf92f3577b34da6a3ce929d0e0e4736";
    let mut body = greedy("/v1/completions", SHORT_PROMPT, false);
    body["max_tokens"] = json!(4);
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/completions", cluster.proxy.url))
        .header("traceparent", format!("00-{trace}-00f067aa0ba902b7-01"))
        .json(&body)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let in_trace = |spans: &[ReceivedSpan]| -> Vec<ReceivedSpan> {
        spans
            .iter()
            .filter(|s| s.trace_id == trace)
            .cloned()
            .collect()
    };
    // The proxy's five spans, and one span from each engine.
    let spans = receiver
        .wait_for(Duration::from_secs(20), |spans| {
            let spans = in_trace(spans);
            spans.iter().filter(|s| s.service == "pd-proxy").count() >= 5
                && spans.iter().filter(|s| s.service != "pd-proxy").count() >= 2
        })
        .await;
    let spans = in_trace(&spans);
    let proxy_span = |name: &str| {
        let found = spans
            .iter()
            .find(|s| s.service == "pd-proxy" && s.name == name);
        found
            .unwrap_or_else(|| panic!("no proxy span {name}: {spans:#?}"))
            .span_id
            .clone()
    };
    let (prefill, decode) = (proxy_span("prefill"), proxy_span("decode"));
    let engines: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.service != "pd-proxy").collect();
    for span in &engines {
        let (service, name, parent) = (&span.service, &span.name, &span.parent_span_id);
        println!("{service}'s span {name:?} under {parent}");
    }
    let parents: Vec<&str> = engines.iter().map(|s| s.parent_span_id.as_str()).collect();
    assert!(
        parents.contains(&prefill.as_str()) && parents.contains(&decode.as_str()),
        "vLLM's spans are under the proxy's prefill ({prefill}) and decode ({decode}) spans: \
         {engines:#?}"
    );
}
