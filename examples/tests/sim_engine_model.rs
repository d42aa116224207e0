//! sim-engine with `--engine-model`: prefills and tokens timed by the model's formula (the
//! quadratic prefill, a decode step that grows with the batch's context), a prefix cache hit
//! that saves its share, the time scale, a full KV cache that queues and preempts and still
//! answers everything, a request that can never fit refused, bad coefficients refused at start,
//! and a P/D pair through pd-proxy whose engines both run the model.

mod common;

use std::time::{Duration, Instant};

use common::{metric, one_pair, post, sim_engine};
use pd_examples::cluster::Cluster;
use serde_json::{json, Value};

/// The preset every test here runs.
const PRESET: &str = "llama3-8b-h200";

/// Llama-3-8B on H200 (`presets.rs`): a whole prefill of `n` uncached tokens, in ms.
fn prefill_ms(n: f64) -> f64 {
    1.4 + 0.0248 * n + 4.4e-7 * n * n
}

/// A prompt of `n` bytes (the sims' tokenizer: one token per byte), distinct per `seed`.
fn prompt(n: usize, seed: u8) -> String {
    (0..n)
        .map(|i| char::from(b'a' + ((i * 7 + usize::from(seed) * 13) % 26) as u8))
        .collect()
}

fn completion(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true})
}

/// POSTs a completion and gives its time and its answer (which must be a 200).
async fn timed(url: &str, body: Value) -> (Duration, Value) {
    let started = Instant::now();
    let (status, answer) = post(url, body).await;
    assert_eq!(status, 200, "{answer}");
    (started.elapsed(), answer)
}

/// `took` is the model's `ms`, give or take what HTTP and a debug build add.
fn assert_near(what: &str, took: Duration, ms: f64) {
    let took = took.as_secs_f64() * 1e3;
    assert!(
        took >= ms * 0.95 && took <= ms * 1.3 + 150.0,
        "{what}: took {took:.1} ms, the model says {ms:.1} ms"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn prefills_and_decodes_take_the_model_s_time_and_the_time_scale_divides_it() {
    let (engine, _dir) = sim_engine(&["--engine-model", PRESET], &[]).await;
    let url = format!("{}/v1/completions", engine.url);
    let long = prompt(8000, 1);
    let (took, _) = timed(&url, completion(&long, 1)).await;
    assert_near("a prefill of 8000 tokens", took, prefill_ms(8000.0));
    // The prefix cache lives in the KV cache: the same prompt again finds all its whole blocks
    // there and computes only the rest (the engine's count says so; the time only roughly,
    // since the other tests share the cores).
    let (again, _) = timed(&url, completion(&long, 1)).await;
    assert!(again < took / 2, "{again:?} against {took:?}");
    assert!(metric(&engine, "vllm:prefix_cache_hits_total").await >= 7_680.0);
    // 200 tokens alone: a step of 4.8 ms + 0.05 ms + the context's KV read, each.
    let (took, answer) = timed(&url, completion("a short prompt", 200)).await;
    assert_eq!(answer["usage"]["completion_tokens"], 200, "{answer}");
    let steps: f64 = (0..200).map(|i| 4.85 + 3.9e-5 * f64::from(14 + i)).sum();
    assert_near("200 tokens", took, steps + prefill_ms(14.0));

    let (fast, _dir) = sim_engine(&["--engine-model", PRESET, "--time-scale", "10"], &[]).await;
    let url = format!("{}/v1/completions", fast.url);
    let (took, _) = timed(&url, completion(&prompt(8000, 2), 1)).await;
    assert_near(
        "the prefill ten times faster",
        took,
        prefill_ms(8000.0) / 10.0,
    );
    let (took, _) = timed(&url, completion("a short prompt", 200)).await;
    assert_near("200 tokens ten times faster", took, steps / 10.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_kv_cache_queues_and_preempts_yet_every_answer_comes_whole() {
    let args = [
        "--engine-model",
        PRESET,
        "--engine-model-set",
        "kv_capacity_tokens=600",
        "--engine-model-set",
        "w_ms=5",
    ];
    let (engine, _dir) = sim_engine(&args, &[]).await;
    let url = format!("{}/v1/completions", engine.url);
    // Four requests of 100 prompt tokens and 200 answer tokens: 1200 KV tokens in 600.
    let requests: Vec<_> = (0..4)
        .map(|i| {
            let (url, body) = (url.clone(), completion(&prompt(100, i), 200));
            tokio::spawn(async move { post(&url, body).await })
        })
        .collect();
    for request in requests {
        let (status, answer) = request.await.unwrap();
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["usage"]["completion_tokens"], 200, "{answer}");
    }
    assert!(metric(&engine, "vllm:num_preemptions_total").await >= 1.0);
    assert_eq!(metric(&engine, "vllm:kv_cache_usage_perc").await, 0.0);
    let (status, answer) = post(&url, completion(&prompt(500, 9), 200)).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer.to_string().contains("KV tokens"), "{answer}");
}

#[tokio::test(flavor = "multi_thread")]
async fn past_max_num_seqs_requests_wait_and_the_metrics_say_so() {
    let args = ["--engine-model", PRESET, "--max-num-seqs", "2"];
    let (engine, _dir) = sim_engine(&args, &[]).await;
    let url = format!("{}/v1/completions", engine.url);
    let requests: Vec<_> = (0..4)
        .map(|i| {
            let (url, body) = (url.clone(), completion(&prompt(50, i), 300));
            tokio::spawn(async move { post(&url, body).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(metric(&engine, "vllm:num_requests_running").await, 2.0);
    assert_eq!(metric(&engine, "vllm:num_requests_waiting").await, 2.0);
    assert!(metric(&engine, "vllm:kv_cache_usage_perc").await > 0.0);
    for request in requests {
        assert_eq!(request.await.unwrap().0, 200);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_model_flags_stop_the_engine_before_it_serves() {
    let cases: [(&[&str], &str); 4] = [
        (
            &["--engine-model", PRESET, "--engine-model-set", "speed=2"],
            "`speed`",
        ),
        (
            &["--engine-model", PRESET, "--engine-model-set", "w_ms=-3"],
            "`w_ms`",
        ),
        (
            &["--engine-model", PRESET, "--kv-cache-blocks", "10"],
            "kv_capacity_tokens",
        ),
        (
            &["--engine-model", PRESET, "--time-scale", "0"],
            "--time-scale",
        ),
    ];
    for (args, named) in cases {
        let run = tokio::process::Command::new(common::binary("sim-engine"))
            .args(["--role", "decode", "--port", "0"])
            .args(args)
            .kill_on_drop(true)
            .output();
        let output = tokio::time::timeout(Duration::from_secs(20), run)
            .await
            .unwrap_or_else(|_| panic!("{args:?} started an engine"))
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?}");
        assert!(stderr.contains(named), "{args:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pd_pair_of_modelled_engines_answers_through_the_proxy() {
    let (mut spec, _run_dir) = one_pair("engine-model-");
    spec.engine_args = ["--engine-model", PRESET]
        .iter()
        .map(|a| a.to_string())
        .collect();
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    let long = prompt(4000, 3);
    let url = format!("{}/v1/completions", cluster.proxy.url);
    let (took, through) = timed(&url, completion(&long, 20)).await;
    assert!(took.as_secs_f64() * 1e3 >= prefill_ms(4000.0), "{took:?}");
    // Equal to the decode serving it alone: the same tokens, from the same prompt.
    let alone = format!("{}/v1/completions", cluster.decodes[0].url);
    let (_, alone) = timed(&alone, completion(&long, 20)).await;
    assert_eq!(through["choices"][0]["text"], alone["choices"][0]["text"]);
    assert_eq!(through["usage"], alone["usage"]);
    let stats: Value = reqwest::get(format!("{}/stats", cluster.decodes[0].url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats["kv_transfers_verified"], 1, "{stats}");
}
