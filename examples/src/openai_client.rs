//! A small OpenAI (and SGLang `/generate`) client for the demo and the end-to-end tests: one
//! completion, whole or streamed, with its time to first token.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;

/// What one request returned.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// The generated text (all chunks joined), or the error body.
    pub text: String,
    /// Time until the first content byte (streamed) or the whole answer.
    pub ttft: Duration,
    /// Time until the end.
    pub total: Duration,
    /// Whether a streamed answer ended with `data: [DONE]`.
    pub done: bool,
    /// The SSE error event, if the stream carried one.
    pub stream_error: Option<String>,
}

/// The text of one chunk or answer of OpenAI's APIs, or SGLang's `text` (whole, or in a
/// streamed event the text so far).
fn choice_text(value: &Value) -> &str {
    if let Some(text) = value.get("text").and_then(Value::as_str) {
        return text;
    }
    let choice = &value["choices"][0];
    choice["text"]
        .as_str()
        .or_else(|| choice["delta"]["content"].as_str())
        .or_else(|| choice["message"]["content"].as_str())
        .unwrap_or("")
}

/// POSTs `body` to `url` (a `/v1/completions`, `/v1/chat/completions` or `/generate` URL) and
/// reads the whole answer, SSE or JSON, within `timeout`.
pub async fn send(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    timeout: Duration,
) -> Result<Answer, String> {
    let started = Instant::now();
    let call = async {
        let response = http
            .post(url)
            .json(body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let is_sse = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if !is_sse {
            let text = response.text().await.map_err(|e| e.to_string())?;
            let elapsed = started.elapsed();
            let parsed: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let content = if status == 200 {
                choice_text(&parsed).to_owned()
            } else {
                text
            };
            return Ok(Answer {
                status,
                text: content,
                ttft: elapsed,
                total: elapsed,
                done: false,
                stream_error: None,
            });
        }
        let mut stream = response.bytes_stream();
        let mut buffer = String::new();
        let mut answer = Answer {
            status,
            text: String::new(),
            ttft: Duration::ZERO,
            total: Duration::ZERO,
            done: false,
            stream_error: None,
        };
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| e.to_string())?;
            buffer.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buffer.find("\n\n") {
                let event: String = buffer.drain(..end + 2).collect();
                let Some(data) = event.trim().strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                if data == "[DONE]" {
                    answer.done = true;
                    continue;
                }
                let value: Value = serde_json::from_str(data).unwrap_or(Value::Null);
                if let Some(error) = value.get("error") {
                    answer.stream_error = Some(error.to_string());
                    continue;
                }
                let piece = choice_text(&value);
                if !piece.is_empty() && answer.text.is_empty() {
                    answer.ttft = started.elapsed();
                }
                if value.get("text").is_some() {
                    // SGLang streams the whole text so far.
                    answer.text = piece.to_owned();
                } else {
                    answer.text.push_str(piece);
                }
            }
        }
        answer.total = started.elapsed();
        Ok(answer)
    };
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| format!("no complete answer within {timeout:?}"))?
}
