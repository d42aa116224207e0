//! The open-loop load of a timed replay: every request of a trace sent at its own timestamp
//! (divided by the speed-up), streamed, whatever the answers before it did; each one's lag
//! behind its schedule measured (a late request is a fact in the report, not silence), its
//! first and last token timed.

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::time::Instant;

use super::prompts::prompt;
use super::trace::Trace;

/// What one request got.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The HTTP status; 0 when no answer came (a transport error, the client's timeout).
    pub status: u16,
    /// Until the first token.
    pub ttft: Option<Duration>,
    /// Until the last token.
    pub last: Option<Duration>,
    /// Tokens streamed.
    pub tokens: u32,
    /// Tokens the trace asked for.
    pub wanted: u32,
    /// How late it was sent behind its schedule.
    pub lag: Duration,
    /// Whether the stream ended with an error event, or cut.
    pub broken: bool,
}

impl Outcome {
    /// A complete answer: a 200 with every token the trace asked for, unbroken.
    pub fn complete(&self) -> bool {
        self.status == 200 && !self.broken && self.tokens >= self.wanted
    }

    /// The mean time per output token after the first (0 for one-token answers).
    pub fn tpot(&self) -> Option<Duration> {
        let (first, last) = (self.ttft?, self.last?);
        Some(match self.tokens {
            0 | 1 => Duration::ZERO,
            n => (last - first) / (n - 1),
        })
    }
}

/// Sends every request of `trace` to `url` at `at / speed` from now, at most `limit`, and waits
/// for every answer (each within `timeout`).
pub async fn replay(
    url: &str,
    trace: &Trace,
    speed: f64,
    limit: Option<usize>,
    timeout: Duration,
) -> Vec<Outcome> {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .expect("a client");
    let count = limit.unwrap_or(usize::MAX).min(trace.requests.len());
    let start = Instant::now() + Duration::from_millis(100);
    let mut answers = Vec::with_capacity(count);
    for (i, request) in trace.requests.iter().take(count).enumerate() {
        let scheduled = start + request.at.div_f64(speed);
        tokio::time::sleep_until(scheduled).await;
        let lag = Instant::now().saturating_duration_since(scheduled);
        let body = json!({
            "model": "sim-model",
            "prompt": prompt(request, trace.block_tokens, i as u64),
            "max_tokens": request.output,
            "ignore_eos": true,
            "stream": true,
        });
        let (http, url, wanted) = (http.clone(), url.to_owned(), request.output);
        answers.push(tokio::spawn(async move {
            let sent = Instant::now();
            let mut outcome = Outcome {
                status: 0,
                ttft: None,
                last: None,
                tokens: 0,
                wanted,
                lag,
                broken: false,
            };
            let _ =
                tokio::time::timeout(timeout, stream(&http, &url, &body, sent, &mut outcome)).await;
            outcome
        }));
    }
    let mut outcomes = Vec::with_capacity(count);
    for answer in answers {
        outcomes.push(answer.await.expect("a replay task does not panic"));
    }
    outcomes
}

/// Reads one streamed answer into `outcome` (left as far as it got when the time runs out).
async fn stream(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    sent: Instant,
    outcome: &mut Outcome,
) {
    let Ok(response) = http.post(url).json(body).send().await else {
        return;
    };
    outcome.status = response.status().as_u16();
    let mut chunks = response.bytes_stream();
    let mut buffer = Vec::new();
    outcome.broken = true;
    while let Some(chunk) = chunks.next().await {
        let Ok(chunk) = chunk else {
            return;
        };
        buffer.extend_from_slice(&chunk);
        while let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buffer.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                outcome.broken = false;
                continue;
            }
            let value: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            if value.get("error").is_some() {
                return;
            }
            let choice = &value["choices"][0];
            let piece = (choice["text"].as_str())
                .or(choice["delta"]["content"].as_str())
                .unwrap_or("");
            if !piece.is_empty() {
                let now = sent.elapsed();
                outcome.ttft.get_or_insert(now);
                outcome.last = Some(now);
                outcome.tokens += 1;
            }
        }
    }
}
