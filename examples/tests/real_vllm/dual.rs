//! Two real vLLM engines of both roles (`"kv_role": "kv_both"`, each with its bootstrap
//! server) behind pd-proxy's `--dual`: their duties swapped four times (`POST /admin/duties`)
//! under a steady greedy load. No request fails, every answer equals one engine's token for
//! token, none waits on a path's first use (each new direction is warmed up before the swap),
//! and each engine pulled KV as a decode (vLLM's own
//! `prompt_tokens_by_source{source="external_kv_transfer"}`): the KV moved both ways.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::*;

/// The steady load of one client: the prompts in turn (odd ones streamed) until `stop`, each
/// answer equal to `expected`'s; the answers and the slowest one's seconds.
async fn steady(
    proxy: String,
    prompts: Arc<Vec<(Value, String)>>,
    stop: Arc<AtomicBool>,
) -> (usize, f64) {
    let http = reqwest::Client::new();
    let (mut answered, mut slowest) = (0, 0.0f64);
    while !stop.load(Ordering::Relaxed) {
        for (body, expected) in prompts.iter() {
            let started = Instant::now();
            let got = text(&http, &proxy, "/v1/completions", body, "the proxy").await;
            slowest = slowest.max(started.elapsed().as_secs_f64());
            assert_eq!(&got, expected, "{body}");
            answered += 1;
        }
    }
    (answered, slowest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_of_both_roles_swap_duties_under_a_steady_load() {
    let _one = ONE_CLUSTER.lock().await;
    let (mut spec, _run_dir) = spec("vllm-dual-", engines(Connector::Mooncake).await);
    spec.dual = true;
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; 2];
    spec.decodes = 0;
    spec.proxy_args = ["--admin-key", "admin", "--metrics-open"]
        .map(String::from)
        .to_vec();
    let cluster = start(&spec).await;
    let http = reqwest::Client::new();
    let (a, b) = (&cluster.prefills[0], &cluster.prefills[1]);
    let mut prompts = Vec::new();
    for i in 0..4 {
        let prompt = format!("{LONG_PROMPT} Request {i}.");
        let body = greedy("/v1/completions", &prompt, i % 2 == 1);
        let expected = reference(&http, a, "/v1/completions", &body).await;
        prompts.push((body, expected));
    }
    let prompts = Arc::new(prompts);
    let pulled = || async {
        (
            prompt_tokens_by_source(a).await.0,
            prompt_tokens_by_source(b).await.0,
        )
    };
    let before = pulled().await;

    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..2)
        .map(|_| {
            tokio::spawn(steady(
                cluster.proxy.url.clone(),
                prompts.clone(),
                stop.clone(),
            ))
        })
        .collect();
    for round in 0..4 {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let (to_a, to_b) = match round % 2 {
            0 => ("decode", "prefill"),
            _ => ("prefill", "decode"),
        };
        let duties = json!({"duties": {&a.url: to_a, &b.url: to_b}});
        let started = Instant::now();
        let response = http
            .post(format!("{}/admin/duties", cluster.proxy.url))
            .bearer_auth("admin")
            .json(&duties)
            .send()
            .await
            .unwrap();
        let status = response.status();
        let answer = response.text().await.unwrap();
        assert_eq!(status, 200, "{answer}");
        eprintln!(
            "swap {round}: {to_a} / {to_b} in {:.2} s (its warm-ups included)",
            started.elapsed().as_secs_f64()
        );
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut answered, mut slowest) = (0, 0.0f64);
    for client in clients {
        let (n, s) = client.await.unwrap();
        answered += n;
        slowest = slowest.max(s);
    }
    let after = pulled().await;
    eprintln!(
        "{answered} answers, all equal to one engine's, the slowest {slowest:.2} s; \
         KV pulled by A {:.0} -> {:.0} tokens, by B {:.0} -> {:.0}",
        before.0, after.0, before.1, after.1
    );
    assert!(answered >= 20, "{answered} answers");
    assert!(
        slowest < 5.0,
        "an answer waited {slowest:.2} s: a path's first use?"
    );
    assert!(
        after.0 > before.0,
        "A pulled no KV as a decode: {before:?} -> {after:?}"
    );
    assert!(
        after.1 > before.1,
        "B pulled no KV as a decode: {before:?} -> {after:?}"
    );
    cluster.shutdown().await;
}
