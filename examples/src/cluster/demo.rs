//! The demo `pd-cluster` runs once the cluster is up: a few requests through the front door,
//! each one's TTFT and total time and its text printed.

use std::time::Duration;

use serde_json::json;

use super::{Process, ServedModel};
use crate::openai_client::send;
use crate::sim::Dialect;

/// The demo's requests: completions and chats (whole and streamed) for the first model, SGLang's
/// `/generate` in SGLang's dialect, and a whole completion for every other model and adapter.
pub async fn run(
    front_door: &Process,
    api_key: Option<&str>,
    dialect: Dialect,
    models: &[ServedModel],
) -> Result<(), String> {
    let proxy = front_door.url.as_str();
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(key) = api_key {
        let value = format!("Bearer {key}")
            .parse()
            .map_err(|_| "the API key is not a header value")?;
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    let http = (front_door.client_tls.apply(reqwest::Client::builder()))
        .default_headers(headers)
        .build()
        .map_err(|err| format!("cannot build an HTTP client: {err}"))?;
    let model = models.first().map_or("", |m| m.name.as_str());
    let prompt = "Explain in one sentence why prefill and decode run on separate GPUs in disaggregated serving";
    let mut requests = vec![
        (
            "completions, whole",
            "/v1/completions",
            json!({"model": model, "prompt": prompt, "max_tokens": 12}),
        ),
        (
            "completions, streamed",
            "/v1/completions",
            json!({"model": model, "prompt": prompt, "max_tokens": 12, "stream": true}),
        ),
        (
            "chat, whole",
            "/v1/chat/completions",
            json!({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}),
        ),
        (
            "chat, streamed",
            "/v1/chat/completions",
            json!({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}}),
        ),
    ];
    let others = models
        .iter()
        .flat_map(|m| std::iter::once(&m.name).chain(&m.adapters))
        .skip(1);
    for name in others {
        let body = json!({"model": name, "prompt": prompt, "max_tokens": 8});
        requests.push((name.as_str(), "/v1/completions", body));
    }
    if dialect == Dialect::Sglang {
        requests.extend([
            (
                "generate, whole",
                "/generate",
                json!({"text": prompt, "sampling_params": {"max_new_tokens": 8}}),
            ),
            (
                "generate, streamed",
                "/generate",
                json!({"text": prompt, "sampling_params": {"max_new_tokens": 8}, "stream": true}),
            ),
        ]);
    }
    println!(
        "\nSending {} requests through the proxy at {proxy}:",
        requests.len()
    );
    for (label, path, body) in requests {
        let answer = send(
            &http,
            &format!("{proxy}{path}"),
            &body,
            Duration::from_secs(30),
        )
        .await?;
        if answer.status != 200 {
            return Err(format!("{label}: HTTP {}: {}", answer.status, answer.text));
        }
        println!(
            "  {label:<22} TTFT {:>6.1} ms  total {:>6.1} ms  ->{}",
            answer.ttft.as_secs_f64() * 1e3,
            answer.total.as_secs_f64() * 1e3,
            printable(&answer.text)
        );
    }
    Ok(())
}

/// `text` with control characters shown as `·`: the tiny model's random tokens include them,
/// and they must not reach the terminal.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { '·' } else { c })
        .collect()
}
