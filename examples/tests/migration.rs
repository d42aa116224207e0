//! A decode lost mid-answer, end to end: sim engines (each token follows from the whole
//! context, so a continuation from the prompt's and the first tokens' ids goes on exactly)
//! with a fault injected into one decode, behind pd-proxy. The client's stream is whole and
//! equal to an undisturbed answer, with one id and the usage of the whole answer; a whole
//! answer whose decode dies is placed again; the migration limit and "no decode left" end the
//! stream cleanly.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use pd_examples::bench::migration;
use pd_examples::cluster::{Cluster, ClusterSpec, PrefillShape};
use serde_json::{json, Value};

/// A cluster of one prefill and `faults.len()` decodes, decode `i` with `faults[i]`'s
/// arguments, pd-proxy choosing decodes in turn with `proxy_args`.
async fn start_cluster(
    name: &str,
    faults: &[&[&str]],
    proxy_args: &[&str],
) -> (Cluster, tempfile::TempDir) {
    let bin_dir = PathBuf::from(env!("CARGO_BIN_EXE_sim-engine"))
        .parent()
        .unwrap()
        .to_path_buf();
    let run_dir = tempfile::Builder::new().prefix(name).tempdir().unwrap();
    let mut spec = ClusterSpec::demo(bin_dir, run_dir.path().to_path_buf());
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }];
    spec.decodes = faults.len();
    spec.decode_ms_per_token = 5;
    spec.decode_args = (faults.iter())
        .map(|args| args.iter().map(|arg| arg.to_string()).collect())
        .collect();
    spec.proxy_args = ["--decode-policy", "round_robin"]
        .iter()
        .chain(proxy_args)
        .map(|arg| arg.to_string())
        .collect();
    let cluster = Cluster::start(&spec).await.expect("the cluster starts");
    (cluster, run_dir)
}

/// A streamed answer as the client saw it.
#[derive(Debug)]
struct Streamed {
    /// The events' JSON (`[DONE]` left out).
    events: Vec<Value>,
    /// Whether it ended with `[DONE]`.
    done: bool,
}

impl Streamed {
    /// The answer's text.
    fn text(&self) -> String {
        let piece = |event: &Value| {
            let choice = &event["choices"][0];
            (choice["text"].as_str())
                .or(choice["delta"]["content"].as_str())
                .unwrap_or_default()
                .to_owned()
        };
        self.events.iter().map(piece).collect()
    }

    /// The error events' messages.
    fn errors(&self) -> Vec<String> {
        (self.events.iter())
            .filter_map(|event| event["error"]["message"].as_str())
            .map(str::to_owned)
            .collect()
    }

    /// The usage chunk's.
    fn usage(&self) -> Option<&Value> {
        self.events.iter().find_map(|event| event.get("usage"))
    }

    /// The ids of the chunks (all the same for one answer).
    fn ids(&self) -> Vec<&str> {
        let mut ids: Vec<&str> = (self.events.iter())
            .filter_map(|event| event["id"].as_str())
            .collect();
        ids.dedup();
        ids
    }
}

/// Streams `body` from the proxy's `path` to its end (within 20 s).
async fn stream(cluster: &Cluster, path: &str, body: &Value) -> Streamed {
    stream_from(&cluster.proxy.url, path, body).await
}

/// Streams `body` from `base` + `path` to its end (within 20 s).
async fn stream_from(base: &str, path: &str, body: &Value) -> Streamed {
    let response = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut bytes = response.bytes_stream();
    let mut text = String::new();
    let read = async {
        while let Some(chunk) = bytes.next().await {
            text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .expect("the stream ends");
    let payloads: Vec<&str> = (text.split("\n\n"))
        .filter(|event| !event.is_empty())
        .map(|event| event.strip_prefix("data: ").expect("every event is data"))
        .collect();
    Streamed {
        done: payloads.last() == Some(&"[DONE]"),
        events: (payloads.iter())
            .filter(|payload| **payload != "[DONE]")
            .map(|payload| serde_json::from_str(payload).unwrap())
            .collect(),
    }
}

/// The proxy's migrations of answers broken by `reason` that ended as `outcome`.
async fn migrations(cluster: &Cluster, reason: &str, outcome: &str) -> u64 {
    migration::migrations(&cluster.proxy.url, reason, outcome)
        .await
        .unwrap()
}

/// A streamed completion of 24 tokens with its usage.
fn completion() -> Value {
    json!({"prompt": "the answer that survives its decode", "max_tokens": 24, "stream": true,
           "stream_options": {"include_usage": true}})
}

/// What every answer of this file must be: whole, one id, no token ids the client did not ask
/// for, the usage of all 24 tokens.
fn assert_whole(answer: &Streamed, reference: &Streamed) {
    assert!(answer.done, "{answer:?}");
    assert!(answer.errors().is_empty(), "{answer:?}");
    assert_eq!(answer.text(), reference.text());
    assert_eq!(answer.ids().len(), 1, "one answer id: {answer:?}");
    let usage = answer.usage().expect("the usage chunk");
    assert_eq!(usage["completion_tokens"], 24, "{usage}");
    assert_eq!(
        usage["prompt_tokens"],
        reference.usage().unwrap()["prompt_tokens"]
    );
    for event in &answer.events {
        let choice = &event["choices"][0];
        assert!(choice.get("token_ids").is_none() && event.get("prompt_token_ids").is_none());
        assert!(choice.get("prompt_token_ids").is_none(), "{event}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_decode_that_dies_mid_answer_is_continued_elsewhere_token_for_token() {
    let fault: &[&str] = &["--fail-after-tokens", "6", "--fail-mode", "exit"];
    let (mut cluster, _dir) = start_cluster("migration-exit-", &[fault, &[]], &[]).await;
    // Decodes in turn: the first request goes to the decode that dies after six tokens.
    let broken = stream(&cluster, "/v1/completions", &completion()).await;
    assert_eq!(migrations(&cluster, "broken", "resumed").await, 1);
    assert!(
        cluster.decodes[0].exited().is_some(),
        "the first decode died"
    );
    // The same request undisturbed, on the decode left.
    let reference = stream(&cluster, "/v1/completions", &completion()).await;
    assert!(
        reference.done && reference.errors().is_empty(),
        "{reference:?}"
    );
    assert_whole(&broken, &reference);
    assert!(!reference.text().trim().is_empty(), "{reference:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_decode_is_left_and_a_chat_goes_on() {
    let fault: &[&str] = &["--fail-after-tokens", "4", "--fail-mode", "stall"];
    let proxy = ["--decode-stall-timeout", "0.5"];
    let (cluster, _dir) = start_cluster("migration-stall-", &[fault, &[]], &proxy).await;
    let chat = json!({"messages": [{"role": "user", "content": "a chat that goes on"}],
                      "max_completion_tokens": 24, "stream": true,
                      "stream_options": {"include_usage": true}});
    // The stalling decode first (in turn); the reference: the other decode alone.
    let started = Instant::now();
    let stalled = stream(&cluster, "/v1/chat/completions", &chat).await;
    let took = started.elapsed();
    assert_eq!(migrations(&cluster, "stalled", "resumed").await, 1);
    let healthy = &cluster.decodes[1].url;
    let reference = stream_from(healthy, "/v1/chat/completions", &chat).await;
    assert_whole(&stalled, &reference);
    assert_eq!(
        stalled.events[0]["choices"][0]["delta"]["role"],
        "assistant"
    );
    assert!(
        stalled
            .events
            .iter()
            .skip(1)
            .all(|e| e["object"] == "chat.completion.chunk"),
        "{stalled:?}"
    );
    assert!(
        took < Duration::from_secs(3),
        "the stall was seen in time: {took:?}"
    );
    assert_eq!(migrations(&cluster, "stalled", "resumed").await, 1);
    // The client asked for the token ids: it gets them, the whole answer's.
    let mut with_ids = chat.clone();
    with_ids["return_token_ids"] = json!(true);
    let answer = stream(&cluster, "/v1/chat/completions", &with_ids).await;
    let ids: usize = (answer.events.iter())
        .filter_map(|event| event["choices"][0]["token_ids"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!((ids, answer.text()), (24, reference.text()), "{answer:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_whole_answer_whose_decode_dies_is_placed_again_with_a_fresh_prefill() {
    let fault: &[&str] = &["--fail-after-tokens", "3", "--fail-mode", "exit"];
    let (cluster, _dir) = start_cluster("migration-whole-", &[fault, &[]], &[]).await;
    let body = json!({"prompt": "a whole answer", "max_tokens": 12});
    let url = format!("{}/v1/completions", cluster.proxy.url);
    let http = reqwest::Client::new();
    let answer = || async {
        http.post(&url)
            .json(&body)
            .send()
            .await?
            .json::<Value>()
            .await
    };
    let first = answer().await.unwrap();
    let again = answer().await.unwrap();
    assert_eq!(
        first["choices"][0]["text"], again["choices"][0]["text"],
        "{first}"
    );
    assert_eq!(first["usage"]["completion_tokens"], 12);
    assert!(first["choices"][0].get("token_ids").is_none());
    assert_eq!(migrations(&cluster, "failed", "resumed").await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn migrations_stop_at_the_limit_and_when_no_decode_is_left() {
    let fault: &[&str] = &["--fail-after-tokens", "4", "--fail-mode", "stall"];
    let proxy = ["--decode-stall-timeout", "0.3", "--migration-limit", "1"];
    let (cluster, _dir) = start_cluster("migration-limit-", &[fault, fault], &proxy).await;
    // Each decode stalls after four tokens: one migration, then the limit.
    let answer = stream(&cluster, "/v1/completions", &completion()).await;
    assert!(answer.done, "{answer:?}");
    let errors = answer.errors();
    assert_eq!(errors.len(), 1, "{answer:?}");
    assert!(errors[0].contains("--migration-limit"), "{errors:?}");
    let tokens = answer
        .events
        .iter()
        .filter(|e| e["choices"][0]["text"].is_string());
    assert_eq!(
        tokens.count(),
        8,
        "four tokens from each decode: {answer:?}"
    );
    assert_eq!(migrations(&cluster, "stalled", "limit").await, 1);

    // One decode: nowhere to go.
    let (cluster, _dir) = start_cluster("migration-alone-", &[fault], &proxy[..2]).await;
    let answer = stream(&cluster, "/v1/completions", &completion()).await;
    assert!(answer.done, "{answer:?}");
    let errors = answer.errors();
    assert!(
        errors.len() == 1 && errors[0].contains("no other engine is ready"),
        "{answer:?}"
    );
    assert_eq!(migrations(&cluster, "stalled", "failed").await, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_error_event_mid_answer_moves_it_unless_it_cannot_go_on_exactly() {
    let fault: &[&str] = &["--fail-after-tokens", "5", "--fail-mode", "error"];
    let (cluster, _dir) = start_cluster("migration-error-", &[fault, &[]], &[]).await;
    // In turn: the failing decode, the other, the failing one again.
    let mut stopped = completion();
    stopped["stop"] = json!(["never said"]);
    let inexact = stream(&cluster, "/v1/completions", &stopped).await;
    assert!(inexact.done, "{inexact:?}");
    assert_eq!(
        inexact.errors().len(),
        1,
        "the decode's own error: {inexact:?}"
    );
    let tokens = inexact
        .events
        .iter()
        .filter(|e| e["choices"][0]["text"].is_string());
    assert_eq!(tokens.count(), 5, "{inexact:?}");
    let reference = stream(&cluster, "/v1/completions", &completion()).await;
    let moved = stream(&cluster, "/v1/completions", &completion()).await;
    assert_whole(&moved, &reference);
    assert_eq!(migrations(&cluster, "error_event", "resumed").await, 1);
}
