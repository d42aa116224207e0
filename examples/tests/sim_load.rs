//! sim-engine under load, as vLLM's and SGLang's schedulers behave: a running batch of at most
//! `--max-num-seqs`, the rest waiting in turn; KV blocks held from admission to the answer's end
//! (`--kv-cache-blocks`), a request longer than the cache refused; tokens slower as the batch
//! grows; and the engines' own metric names for all of it on `/metrics`.

mod common;

use std::time::{Duration, Instant};

use common::{metric, post, sim_engine};
use serde_json::json;

fn completion(tokens: u32) -> serde_json::Value {
    json!({"model": "sim-model", "prompt": "a prompt of some length", "max_tokens": tokens})
}

#[tokio::test(flavor = "multi_thread")]
async fn past_the_batch_requests_wait_and_the_metrics_say_so() {
    let args = [
        "--max-num-seqs",
        "2",
        "--kv-cache-blocks",
        "20",
        "--decode-ms-per-token",
        "20",
    ];
    let (engine, _dir) = sim_engine(&args, &[]).await;
    let url = format!("{}/v1/completions", engine.url);
    let requests: Vec<_> = (0..5)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, completion(20)).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(metric(&engine, "vllm:num_requests_running").await, 2.0);
    assert_eq!(metric(&engine, "vllm:num_requests_waiting").await, 3.0);
    // Each holds the blocks of its prompt and 20 tokens: 3 of 20.
    assert_eq!(metric(&engine, "vllm:kv_cache_usage_perc").await, 0.3);
    let started = Instant::now();
    for request in requests {
        assert_eq!(request.await.unwrap().0, 200);
    }
    // Three rounds of 20 tokens at 20 ms, the first already under way.
    assert!(
        started.elapsed() > Duration::from_millis(600),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(metric(&engine, "vllm:num_requests_running").await, 0.0);
    assert_eq!(metric(&engine, "vllm:kv_cache_usage_perc").await, 0.0);
    let (status, answer) = post(&url, completion(400)).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer.to_string().contains("KV blocks"), "{answer}");
}

#[tokio::test(flavor = "multi_thread")]
async fn tokens_slow_down_as_the_batch_grows() {
    let args = ["--batch-slowdown", "1", "--decode-ms-per-token", "20"];
    let (engine, _dir) = sim_engine(&args, &[]).await;
    let url = format!("{}/v1/completions", engine.url);
    let started = Instant::now();
    assert_eq!(post(&url, completion(10)).await.0, 200);
    let alone = started.elapsed();
    let started = Instant::now();
    let (a, b) = tokio::join!(post(&url, completion(10)), post(&url, completion(10)));
    assert_eq!((a.0, b.0), (200, 200));
    let together = started.elapsed();
    // Two at once: each token takes twice as long.
    assert!(
        together > alone.mul_f64(1.6),
        "alone {alone:?}, together {together:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sglangs_engine_reports_under_sglangs_names() {
    let args = [
        "--dialect",
        "sglang",
        "--max-num-seqs",
        "1",
        "--kv-cache-blocks",
        "8",
    ];
    let (engine, _dir) = sim_engine(&args, &[]).await;
    assert_eq!(metric(&engine, "sglang:num_running_reqs").await, 0.0);
    assert_eq!(metric(&engine, "sglang:num_queue_reqs").await, 0.0);
    assert_eq!(metric(&engine, "sglang:token_usage").await, 0.0);
    let text = reqwest::get(format!("{}/metrics", engine.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!text.contains("vllm:num_requests"), "{text}");
}
