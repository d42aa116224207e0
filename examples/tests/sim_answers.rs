//! sim-engine's answers as a model's: each token follows from the whole context, so an answer
//! continued from its prompt's token ids plus its first tokens' ids (vLLM's `return_token_ids`
//! gives both) goes on exactly as it would have; and injected failures mid-answer: the engine
//! that dies (`--fail-mode exit`) or the answer that hangs (`--fail-mode stall`) after
//! `--fail-after-tokens` tokens.

mod common;

use std::time::Duration;

use common::sim_engine;
use futures_util::StreamExt;
use serde_json::{json, Value};

/// The streamed events' JSON payloads (`[DONE]` left out), read until the stream ends or
/// `quiet` passes without a byte; and whether it ended with `[DONE]`.
async fn events(url: &str, body: Value, quiet: Duration) -> (Vec<Value>, bool) {
    let response = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut stream = response.bytes_stream();
    let mut text = String::new();
    while let Ok(Some(Ok(chunk))) = tokio::time::timeout(quiet, stream.next()).await {
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let payloads: Vec<&str> = (text.split("\n\n"))
        .filter_map(|event| event.strip_prefix("data: "))
        .collect();
    let done = payloads.last() == Some(&"[DONE]");
    let values = (payloads.iter())
        .filter(|p| **p != "[DONE]")
        .map(|p| serde_json::from_str(p).unwrap())
        .collect();
    (values, done)
}

/// The generated token ids and text of a streamed answer's events.
fn generated(events: &[Value]) -> (Vec<u64>, String) {
    let mut ids = Vec::new();
    let mut text = String::new();
    for event in events {
        let choice = &event["choices"][0];
        if let Some(list) = choice["token_ids"].as_array() {
            ids.extend(list.iter().map(|id| id.as_u64().unwrap()));
        }
        let piece = choice["text"]
            .as_str()
            .or(choice["delta"]["content"].as_str());
        text.push_str(piece.unwrap_or(""));
    }
    (ids, text)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_answer_continued_from_its_token_ids_goes_on_as_it_would_have() {
    let (engine, _dir) = sim_engine(&[], &[]).await;
    let quiet = Duration::from_secs(5);
    for (path, first) in [
        ("/v1/completions", json!({"prompt": "a prompt to continue"})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "a chat to continue"}]}),
        ),
    ] {
        let url = format!("{}{path}", engine.url);
        let mut whole = first.clone();
        whole["max_tokens"] = json!(10);
        whole["stream"] = json!(true);
        whole["return_token_ids"] = json!(true);
        let (answer, done) = events(&url, whole, quiet).await;
        assert!(done, "{path}");
        let prompt_ids = answer[0]["choices"][0]["prompt_token_ids"].clone();
        assert!(
            prompt_ids.as_array().is_some_and(|ids| !ids.is_empty()),
            "{answer:?}"
        );
        let (ids, text) = generated(&answer);
        assert_eq!(ids.len(), 10, "{path}: {answer:?}");
        // The same answer's last six tokens, from the prompt's ids and its first four: a
        // completion whose prompt is token ids.
        let mut context: Vec<Value> = prompt_ids.as_array().unwrap().clone();
        context.extend(ids[..4].iter().map(|id| json!(id)));
        let rest = json!({"prompt": context, "max_tokens": 6, "stream": true,
                          "return_token_ids": true});
        let completions = format!("{}/v1/completions", engine.url);
        let (continued, done) = events(&completions, rest, quiet).await;
        assert!(done);
        let (rest_ids, rest_text) = generated(&continued);
        assert_eq!(rest_ids, ids[4..], "{path}");
        assert!(
            text.ends_with(&rest_text),
            "{path}: {text:?} / {rest_text:?}"
        );
        // Without the flag, no ids.
        let mut plain = first.clone();
        plain["stream"] = json!(true);
        let (answer, _) = events(&url, plain, quiet).await;
        assert!(answer[0]["choices"][0].get("token_ids").is_none());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_injected_failure_cuts_or_hangs_the_answer_after_n_tokens() {
    let body = json!({"prompt": "a failing answer", "max_tokens": 10, "stream": true});
    let args = ["--fail-after-tokens", "3", "--fail-mode", "stall"];
    let (engine, _dir) = sim_engine(&args, &[]).await;
    let url = format!("{}/v1/completions", engine.url);
    let (answer, done) = events(&url, body.clone(), Duration::from_millis(500)).await;
    assert_eq!(
        (answer.len(), done),
        (3, false),
        "stalled after three: {answer:?}"
    );
    // The engine itself still answers.
    let health = reqwest::get(format!("{}/health", engine.url))
        .await
        .unwrap();
    assert_eq!(health.status(), 200);

    let args = ["--fail-after-tokens", "3", "--fail-mode", "exit"];
    let (engine, _dir) = sim_engine(&args, &[]).await;
    let url = format!("{}/v1/completions", engine.url);
    let (answer, done) = events(&url, body, Duration::from_secs(5)).await;
    assert_eq!(
        (answer.len(), done),
        (3, false),
        "cut after three: {answer:?}"
    );
    let health = reqwest::get(format!("{}/health", engine.url)).await;
    assert!(health.is_err(), "the engine died");
}
