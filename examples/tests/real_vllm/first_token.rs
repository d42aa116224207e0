//! Requests as users send them, without `ignore_eos`: answers that end at their first token
//! (EOS forced by `logit_bias`, a `stop_token_ids` or `stop` string the first token matches),
//! and parallel sampling (`n`, and `best_of`, which vLLM 0.32 takes and ignores; pd-proxy
//! serves both on a decode alone, see docs/proxy.md). vLLM's
//! connectors send P's KV only for a request that ends on its length cap, so each of these
//! would leave D waiting for KV that never comes unless P is sent `min_tokens`; each must equal
//! one engine's answer (every choice's text and finish reason, and the usage), whole and
//! streamed, and come at once.

use super::*;

/// What a client compares of an answer: each choice's text and finish reason, and the usage.
#[derive(Debug, PartialEq)]
struct Answered {
    choices: Vec<(String, Value)>,
    usage: Value,
}

/// POSTs `body` to `base` + `path` (streamed when it says so): the answer and how long it took.
async fn answered(http: &reqwest::Client, base: &str, path: &str, body: &Value) -> (Answered, f64) {
    let started = Instant::now();
    let response = http
        .post(format!("{base}{path}"))
        .json(body)
        .timeout(Duration::from_secs(25))
        .send()
        .await
        .unwrap_or_else(|err| panic!("{base}{path} {body}: {err}"));
    assert_eq!(response.status(), 200, "{base}{path} {body}");
    let text = response
        .text()
        .await
        .unwrap_or_else(|err| panic!("{base}{path} {body}: {err}"));
    let mut choices: Vec<(String, Value)> = Vec::new();
    let mut usage = Value::Null;
    let mut take = |answer: &Value, delta: &str| {
        for choice in answer["choices"].as_array().into_iter().flatten() {
            let index = choice["index"].as_u64().unwrap() as usize;
            if choices.len() <= index {
                choices.resize(index + 1, (String::new(), Value::Null));
            }
            let piece = (choice["text"].as_str())
                .or(choice[delta]["content"].as_str())
                .unwrap_or("");
            choices[index].0.push_str(piece);
            if !choice["finish_reason"].is_null() {
                choices[index].1 = choice["finish_reason"].clone();
            }
        }
        if !answer["usage"].is_null() {
            let u = &answer["usage"];
            usage = json!([
                u["prompt_tokens"],
                u["completion_tokens"],
                u["total_tokens"]
            ]);
        }
    };
    if body["stream"] == true {
        for event in text
            .split("\n\n")
            .filter_map(|e| e.trim().strip_prefix("data: "))
        {
            if event != "[DONE]" {
                take(&serde_json::from_str(event).unwrap(), "delta");
            }
        }
    } else {
        take(&serde_json::from_str(&text).unwrap(), "message");
    }
    let seconds = started.elapsed().as_secs_f64();
    (Answered { choices, usage }, seconds)
}

/// The model's EOS token id, from its generation config.
fn eos_id(model: &str) -> u64 {
    let config = std::fs::read_to_string(format!("{model}/generation_config.json")).unwrap();
    let config: Value = serde_json::from_str(&config).unwrap();
    config["eos_token_id"].as_u64().expect("an EOS id")
}

/// Every case through the cluster's front door equals the prefill engine's own answer (asked
/// alone, with a cache salt of its own), and comes within seconds; one line per case on stderr.
pub(super) async fn assert_first_token_answers_equal_one_engine(cluster: &Cluster, model: &str) {
    let http = (cluster.proxy.client_tls.apply(reqwest::Client::builder()))
        .build()
        .unwrap();
    let engine = &cluster.prefills[0];
    let name = vllm::TINY_MODEL_NAME;
    let base = json!({"model": name, "prompt": SHORT_PROMPT, "max_tokens": 12, "temperature": 0});
    let chat = json!({"model": name, "max_tokens": 12, "temperature": 0,
                      "messages": [{"role": "user", "content": SHORT_PROMPT}]});
    let with = |body: &Value, field: &str, value: Value| {
        let mut body = body.clone();
        body[field] = value;
        body
    };
    // The first greedy token of each prompt: its id and its text (a byte-level piece of the
    // tiny model's vocabulary may show as none: the stop string needs a prompt whose does).
    let first = |prompt: &'static str| {
        let mut probe = with(&base, "prompt", json!(prompt));
        probe["max_tokens"] = json!(1);
        probe["return_token_ids"] = json!(true);
        let request = http
            .post(format!("{}/v1/completions", engine.url))
            .json(&probe);
        async move {
            let first = json_of(request).await;
            let text = first["choices"][0]["text"].as_str().unwrap().to_owned();
            (first["choices"][0]["token_ids"][0].clone(), text)
        }
    };
    let (first_id, _) = first(SHORT_PROMPT).await;
    let mut stop_string = None;
    for prompt in ["hello there", "Hello world", "The sky is", LONG_PROMPT] {
        let (_, text) = first(prompt).await;
        if !text.is_empty() {
            stop_string = Some((prompt, text));
            break;
        }
    }
    let (stop_prompt, stop_text) = stop_string.expect("a prompt whose first token shows as text");
    let eos = json!({eos_id(model).to_string(): 100});
    let sampled = with(&with(&base, "temperature", json!(0.8)), "seed", json!(7));
    let cases = [
        (
            "completion, EOS forced",
            "/v1/completions",
            with(&base, "logit_bias", eos.clone()),
        ),
        (
            "chat, EOS forced",
            "/v1/chat/completions",
            with(&chat, "logit_bias", eos),
        ),
        (
            "completion, stop_token_ids",
            "/v1/completions",
            with(&base, "stop_token_ids", json!([first_id])),
        ),
        (
            "completion, stop string",
            "/v1/completions",
            with(
                &with(&base, "prompt", json!(stop_prompt)),
                "stop",
                json!([stop_text]),
            ),
        ),
        (
            "completion, n=2",
            "/v1/completions",
            with(&sampled, "n", json!(2)),
        ),
        (
            "completion, best_of=2",
            "/v1/completions",
            with(&sampled, "best_of", json!(2)),
        ),
    ];
    for (what, path, body) in cases {
        for stream in [false, true] {
            let mut body = with(&body, "stream", json!(stream));
            if stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            let (through, seconds) = answered(&http, &cluster.proxy.url, path, &body).await;
            let alone = with(&body, "cache_salt", json!(uuid::Uuid::new_v4().to_string()));
            let (expected, _) = answered(&http, &engine.url, path, &alone).await;
            let equal = through == expected;
            eprintln!(
                "{what}, stream={stream}: 200 in {seconds:.2} s, equal to one engine: {equal}"
            );
            assert_eq!(through, expected, "{what}: {body}");
            assert!(seconds < 10.0, "{what}: {seconds} s");
            if !what.starts_with("completion, n") && !what.contains("best_of") {
                let (_, reason) = &through.choices[0];
                assert_eq!(
                    reason, "stop",
                    "{what} ends at its first token: {through:?}"
                );
            }
        }
    }
}
