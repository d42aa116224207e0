//! Answers that end at their first token, through the whole P/D path (bootstrap server, sim
//! engines, pd-proxy on 127.0.0.1), equal to one engine's: the sims play vLLM's connector rule
//! (P sends its KV only when it ends on its length cap; a stop token ends it first unless
//! `min_tokens` masks it), so a proxy that let P stop would leave D waiting for KV that never
//! comes. With `--ignore-min-tokens` the engines play one that ignores `min_tokens`: the proxy
//! then cancels D and has the decode serve the request alone, at once.

mod common;

use std::time::{Duration, Instant};

use common::{one_pair, sim_engine};
use futures_util::StreamExt;
use pd_examples::cluster::Cluster;
use pd_examples::sim::Dialect;
use serde_json::{json, Value};

/// How long an answer may take: far below the sims' `--kv-wait`, so a D left waiting fails.
const QUICK: Duration = Duration::from_secs(5);

/// A cluster of one prefill and one decode with `proxy_args` and `engine_args`.
async fn cluster(
    dialect: Dialect,
    proxy_args: &[&str],
    engine_args: &[&str],
) -> (Cluster, tempfile::TempDir) {
    let (mut spec, run_dir) = one_pair("first-stop-");
    spec.prefill_us_per_token = 50;
    spec.decode_ms_per_token = 1;
    spec.dialect = dialect;
    spec.proxy_args = proxy_args.iter().map(|a| a.to_string()).collect();
    // D would wait this long for KV that never comes: the answers must not.
    spec.engine_args = ["--kv-wait", "30"]
        .iter()
        .chain(engine_args)
        .map(|a| a.to_string())
        .collect();
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    (cluster, run_dir)
}

/// What a client compares of an answer: its text, finish reason and usage.
#[derive(Debug, PartialEq)]
struct Seen {
    text: String,
    finish_reason: Value,
    usage: Value,
}

/// POSTs `body` to `url` (streamed when it says so) and reads the answer within [`QUICK`].
async fn ask(url: &str, body: &Value) -> Seen {
    let started = Instant::now();
    let response = reqwest::Client::new()
        .post(url)
        .json(body)
        .timeout(QUICK)
        .send()
        .await
        .unwrap_or_else(|err| panic!("{url} {body}: {err}"));
    assert_eq!(response.status(), 200, "{url} {body}");
    let seen = if body["stream"] == true {
        let mut text = String::new();
        let mut stream = response.bytes_stream();
        while let Some(chunk) = stream.next().await {
            text.push_str(std::str::from_utf8(&chunk.expect("the stream ends well")).unwrap());
        }
        let mut seen = Seen {
            text: String::new(),
            finish_reason: Value::Null,
            usage: Value::Null,
        };
        for event in text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
            if event == "[DONE]" {
                continue;
            }
            let event: Value = serde_json::from_str(event).unwrap();
            if let Some(choice) = event["choices"].get(0) {
                let piece = choice["text"]
                    .as_str()
                    .or(choice["delta"]["content"].as_str());
                seen.text.push_str(piece.unwrap_or(""));
                if !choice["finish_reason"].is_null() {
                    seen.finish_reason = choice["finish_reason"].clone();
                }
            }
            if !event["usage"].is_null() {
                seen.usage = event["usage"].clone();
            }
        }
        seen
    } else {
        let answer: Value = response.json().await.unwrap();
        let choice = &answer["choices"][0];
        Seen {
            text: choice["text"]
                .as_str()
                .or(choice["message"]["content"].as_str())
                .unwrap()
                .to_owned(),
            finish_reason: choice["finish_reason"].clone(),
            usage: answer["usage"].clone(),
        }
    };
    assert!(
        started.elapsed() < QUICK,
        "{url} {body} took {:?}",
        started.elapsed()
    );
    seen
}

/// The OpenAI cases: a completion and a chat whose first greedy token is one of their
/// `stop_token_ids`, whole and streamed (with usage).
async fn openai_cases(engine: &str) -> Vec<(&'static str, Value)> {
    let prompt = "an answer that ends at once";
    let chat = json!([{"role": "user", "content": prompt}]);
    let first = |path: &'static str, mut body: Value| async move {
        body["max_tokens"] = json!(1);
        body["return_token_ids"] = json!(true);
        let (_, answer) = common::post(&format!("{engine}{path}"), body).await;
        answer["choices"][0]["token_ids"][0].clone()
    };
    let completion = json!({"model": "sim-model", "prompt": prompt});
    let stop = first("/v1/completions", completion.clone()).await;
    let chat_body = json!({"model": "sim-model", "messages": chat});
    let chat_stop = first("/v1/chat/completions", chat_body.clone()).await;
    let mut cases = Vec::new();
    for stream in [false, true] {
        let mut body = completion.clone();
        body["max_tokens"] = json!(12);
        body["stop_token_ids"] = json!([stop]);
        body["stream"] = json!(stream);
        body["stream_options"] = json!({"include_usage": true});
        cases.push(("/v1/completions", body));
        let mut body = chat_body.clone();
        body["max_tokens"] = json!(12);
        body["stop_token_ids"] = json!([chat_stop]);
        body["stream"] = json!(stream);
        body["stream_options"] = json!({"include_usage": true});
        cases.push(("/v1/chat/completions", body));
    }
    for (_, body) in &mut cases {
        if body["stream"] == false {
            body.as_object_mut().unwrap().remove("stream_options");
        }
    }
    cases
}

/// Every case answered through the proxy as the engine alone answers it, quickly.
async fn answers_equal_one_engines(cluster: &Cluster, engine: &str) {
    for (path, body) in openai_cases(engine).await {
        let alone = ask(&format!("{engine}{path}"), &body).await;
        assert_eq!(
            alone.finish_reason, "stop",
            "the case stops at its first token: {body}"
        );
        assert_eq!(alone.usage["completion_tokens"], 1, "{body}");
        let proxied = ask(&format!("{}{path}", cluster.proxy.url), &body).await;
        assert_eq!(proxied, alone, "{path} {body}");
    }
}

/// The proxy's count of P calls that ended before their cap.
async fn prefill_stops(cluster: &Cluster) -> u64 {
    let text = reqwest::get(format!("{}/metrics", cluster.proxy.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|line| line.starts_with("pd_proxy_prefill_stopped_total{"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_token_stop_is_answered_as_one_engine_answers_it_in_both_vllm_modes() {
    let (engine, _engine_dir) = sim_engine(&[], &[]).await;
    for mode in ["concurrent", "sequential"] {
        let (cluster, _dir) = cluster(Dialect::Vllm, &["--mode", mode], &[]).await;
        answers_equal_one_engines(&cluster, &engine.url).await;
        // P was sent min_tokens, so it never ended short of its cap.
        assert_eq!(prefill_stops(&cluster).await, 0, "{mode}");
        cluster.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_ignores_min_tokens_has_the_decode_serve_alone_at_once() {
    let ignoring = ["--ignore-min-tokens"];
    let (engine, _engine_dir) = sim_engine(&ignoring, &[]).await;
    for mode in ["concurrent", "sequential"] {
        let (cluster, _dir) = cluster(Dialect::Vllm, &["--mode", mode], &ignoring).await;
        answers_equal_one_engines(&cluster, &engine.url).await;
        assert_eq!(
            prefill_stops(&cluster).await,
            4,
            "{mode}: every case's P stopped"
        );
        // An answer that goes past its first token still goes through P and D.
        let body = json!({"model": "sim-model", "prompt": "a longer one", "max_tokens": 5});
        let seen = ask(&format!("{}/v1/completions", cluster.proxy.url), &body).await;
        assert_eq!(
            (seen.finish_reason, seen.usage["completion_tokens"].clone()),
            (json!("length"), json!(5))
        );
        assert_eq!(prefill_stops(&cluster).await, 4, "{mode}");
        cluster.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglangs_first_token_stop_is_answered_as_one_engine_answers_it() {
    // SGLang's P sends its KV whatever its first token: the proxy passes the request on as it is.
    let (engine, _engine_dir) = sim_engine(&["--dialect", "sglang"], &[]).await;
    let (cluster, _dir) = cluster(Dialect::Sglang, &[], &[]).await;
    for (path, body) in openai_cases(&engine.url).await {
        let alone = ask(&format!("{}{path}", engine.url), &body).await;
        assert_eq!(alone.finish_reason, "stop", "{body}");
        let proxied = ask(&format!("{}{path}", cluster.proxy.url), &body).await;
        assert_eq!(proxied, alone, "{path} {body}");
    }
    cluster.shutdown().await;
}
