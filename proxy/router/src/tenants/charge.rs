//! What a request is charged against its tenant's token limits, and how a tenant's standing
//! reads in OpenAI's `x-ratelimit-*` headers, the same for both front doors.
//!
//! A request is charged as OpenAI charges it: its prompt's tokens estimated from its size (a
//! quarter of the bytes of `prompt`, `messages`, `text`, `input_ids` or `input`), and its output tokens
//! as the most it may generate (`max_tokens`, `max_completion_tokens`, SGLang's
//! `sampling_params.max_new_tokens`; vLLM's default of 16 for a completion,
//! [`UNBOUNDED_OUTPUT`] for a chat or `/generate` that names no limit), for each of the answers
//! it asks for (`n`, `best_of`, a batch of prompts). Numbers are read as the engines read them
//! (`"64"` is 64); a negative one counts as 0.

use std::time::Duration;

use super::{RateStatus, Standing};
use crate::body::Body;

/// The output tokens charged to a chat or `/generate` request that names no limit.
pub const UNBOUNDED_OUTPUT: f64 = 1024.0;

/// vLLM's `max_tokens` of a completion that names none.
pub const COMPLETION_DEFAULT: f64 = 16.0;

/// Which API a request calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
    /// SGLang's `/generate`.
    Generate,
    /// An API that generates no tokens (embeddings, scores, classification, tokenize):
    /// charged its input's size only.
    NoOutput,
    /// Any other path (vLLM's `/invocations`, `/v1/responses`...): it may generate, so it is
    /// charged its largest output limit named, or as a chat that names none.
    Other,
}

/// The paths of vLLM's and SGLang's APIs that generate no tokens.
const NO_OUTPUT_PATHS: [&str; 11] = [
    "/v1/embeddings",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
    "/tokenize",
    "/detokenize",
    "/encode",
];

impl Api {
    /// The API a request path calls.
    pub fn of_path(path: &str) -> Api {
        match path {
            "/v1/completions" => Api::Completions,
            "/v1/chat/completions" => Api::Chat,
            "/generate" => Api::Generate,
            _ if NO_OUTPUT_PATHS.contains(&path) => Api::NoOutput,
            _ => Api::Other,
        }
    }
}

/// The most answers one request is charged for (a larger `n` is charged as this many).
const MAX_COPIES: f64 = 1024.0;

/// The most output tokens a request names, and the field that names it, as vLLM reads them:
/// a completion's `max_tokens` (its `max_completion_tokens` is not read); a chat's
/// `max_completion_tokens`, or its `max_tokens` when that is absent or 0; `/generate`'s
/// `sampling_params.max_new_tokens`; on another path the largest of `max_tokens`,
/// `max_completion_tokens` and `max_output_tokens`. `None` when the request names none.
pub fn output_limit(api: Api, body: &Body<'_>) -> Option<(&'static str, f64)> {
    let named = |field: &'static str| body.number(field).map(|n| (field, n));
    match api {
        Api::Completions => named("max_tokens"),
        Api::Chat => named("max_completion_tokens")
            .filter(|(_, n)| *n != 0.0)
            .or_else(|| named("max_tokens")),
        Api::Generate => {
            let params = body.get("sampling_params")?;
            let params = Body::parse(params.get().as_bytes()).ok()?;
            params
                .number("max_new_tokens")
                .map(|n| ("max_new_tokens", n))
        }
        Api::NoOutput => None,
        Api::Other => ["max_tokens", "max_completion_tokens", "max_output_tokens"]
            .into_iter()
            .filter_map(named)
            .max_by(|a, b| a.1.total_cmp(&b.1)),
    }
}

/// A request's charge: (prompt tokens, estimated; output tokens, at most).
pub fn cost(api: Api, body: &Body<'_>) -> (f64, f64) {
    let size = |field: &str| body.get(field).map_or(0, |value| value.get().len());
    let prompt_bytes =
        size("prompt") + size("messages") + size("text") + size("input_ids") + size("input");
    let number = |field: &str| body.number(field).map(|n| n.max(0.0));
    let each = match (output_limit(api, body), api) {
        (Some((_, limit)), _) => limit.max(0.0),
        (None, Api::Completions) => COMPLETION_DEFAULT,
        (None, Api::Chat | Api::Generate | Api::Other) => UNBOUNDED_OUTPUT,
        (None, Api::NoOutput) => 0.0,
    };
    let copies = [number("n"), number("best_of")]
        .into_iter()
        .flatten()
        .fold(1.0, f64::max)
        .min(MAX_COPIES);
    let batch = ["prompt", "text"]
        .iter()
        .find_map(|field| body.get(field).map(|value| prompts_in(value.get())))
        .unwrap_or(1.0);
    ((prompt_bytes as f64 / 4.0).ceil(), each * copies * batch)
}

/// How many prompts a `prompt` (or SGLang's `text`) holds: a list of strings or of token-id
/// lists is a batch; a string or one list of token ids is one.
fn prompts_in(json: &str) -> f64 {
    let Ok(serde_json::Value::Array(items)) = serde_json::from_str::<serde_json::Value>(json)
    else {
        return 1.0;
    };
    match items.first() {
        Some(serde_json::Value::String(_) | serde_json::Value::Array(_)) => {
            (items.len() as f64).max(1.0)
        }
        _ => 1.0,
    }
}

/// The `x-ratelimit-*` headers of `status`: `limit`, `remaining` and `reset` of the requests
/// (per second here, per minute at OpenAI) and of the tightest token limit (per minute).
pub fn rate_headers(status: &RateStatus) -> Vec<(String, String)> {
    let mut headers = Vec::new();
    let mut put = |family: &str, standing: &Standing| {
        headers.push((format!("x-ratelimit-limit-{family}"), whole(standing.limit)));
        headers.push((
            format!("x-ratelimit-remaining-{family}"),
            whole(standing.remaining),
        ));
        headers.push((
            format!("x-ratelimit-reset-{family}"),
            reset_text(standing.reset),
        ));
    };
    if let Some(requests) = &status.requests {
        put("requests", requests);
    }
    if let Some(tokens) = &status.tokens {
        put("tokens", tokens);
    }
    headers
}

fn whole(n: f64) -> String {
    (n.max(0.0).floor() as u64).to_string()
}

/// A reset time as OpenAI writes it: `250ms`, `1.5s`, `6m0s`.
pub fn reset_text(reset: Duration) -> String {
    let millis = reset.as_millis();
    if millis < 1000 {
        return format!("{millis}ms");
    }
    let seconds = reset.as_secs_f64();
    let minutes = (seconds / 60.0).floor();
    let rest = ((seconds - minutes * 60.0) * 1000.0).round() / 1000.0;
    match minutes > 0.0 {
        true => format!("{minutes}m{rest}s"),
        false => format!("{rest}s"),
    }
}

/// `Retry-After` (whole seconds, at least one) and `retry-after-ms` of a wait.
pub fn retry_after(wait: Duration) -> (u64, u64) {
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    let millis = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
    (seconds.max(1), millis.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_charged_their_size_and_their_most_output() {
        let completion = br#"{"model":"m","prompt":"0123456789abcdef","max_tokens":40}"#;
        let body = Body::parse(completion).unwrap();
        assert_eq!(cost(Api::Completions, &body), (5.0, 40.0));
        let bare = Body::parse(br#"{"prompt":"hi"}"#).unwrap();
        assert_eq!(cost(Api::Completions, &bare).1, COMPLETION_DEFAULT);
        let chat = br#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":7,"max_tokens":99}"#;
        assert_eq!(cost(Api::Chat, &Body::parse(chat).unwrap()).1, 7.0);
        // vLLM's `max_completion_tokens or max_tokens`; a completion reads `max_tokens` only.
        let zero = br#"{"messages":[],"max_completion_tokens":0,"max_tokens":9}"#;
        assert_eq!(cost(Api::Chat, &Body::parse(zero).unwrap()).1, 9.0);
        let other = br#"{"prompt":"hi","max_completion_tokens":500}"#;
        let other = Body::parse(other).unwrap();
        assert_eq!(cost(Api::Completions, &other).1, COMPLETION_DEFAULT);
        // An API that generates nothing (embeddings): its input, no output.
        let embeddings = Body::parse(br#"{"model":"m","input":"0123456789abcdef"}"#).unwrap();
        let of = |path: &str, body: &Body<'_>| cost(Api::of_path(path), body);
        assert_eq!(of("/v1/embeddings", &embeddings), (5.0, 0.0));
        // Another path may generate: its largest limit named, else a chat's default.
        let invocation = Body::parse(br#"{"prompt":"x","max_tokens":100000}"#).unwrap();
        assert_eq!(of("/invocations", &invocation).1, 100000.0);
        let response = Body::parse(br#"{"input":"x","max_output_tokens":"50"}"#).unwrap();
        assert_eq!(of("/v1/responses", &response).1, 50.0);
        assert_eq!(of("/v1/responses", &embeddings).1, UNBOUNDED_OUTPUT);
        let unbounded = Body::parse(br#"{"messages":[]}"#).unwrap();
        assert_eq!(cost(Api::Chat, &unbounded).1, UNBOUNDED_OUTPUT);
        let generate = br#"{"text":"hello","sampling_params":{"max_new_tokens":12}}"#;
        assert_eq!(
            cost(Api::Generate, &Body::parse(generate).unwrap()),
            (2.0, 12.0)
        );
    }

    #[test]
    fn every_answer_asked_for_is_charged_and_nothing_refills() {
        let output = |body: &[u8], api| cost(api, &Body::parse(body).unwrap()).1;
        let completion = |body: &[u8]| output(body, Api::Completions);
        // Numbers as strings, as the engines coerce them.
        assert_eq!(completion(br#"{"prompt":"p","max_tokens":"64"}"#), 64.0);
        // n, best_of and batches multiply.
        assert_eq!(completion(br#"{"prompt":"p","max_tokens":10,"n":3}"#), 30.0);
        assert_eq!(
            completion(br#"{"prompt":"p","max_tokens":10,"n":2,"best_of":5}"#),
            50.0
        );
        assert_eq!(
            completion(br#"{"prompt":["a","b","c"],"max_tokens":10}"#),
            30.0
        );
        assert_eq!(completion(br#"{"prompt":[1,2,3],"max_tokens":10}"#), 10.0);
        assert_eq!(completion(br#"{"prompt":[[1],[2]],"max_tokens":10}"#), 20.0);
        let batch = br#"{"text":["a","b"],"sampling_params":{"max_new_tokens":7}}"#;
        assert_eq!(output(batch, Api::Generate), 14.0);
        // A negative ask is charged nothing, never refills.
        let negative = br#"{"text":"a","sampling_params":{"max_new_tokens":-1e12}}"#;
        assert_eq!(output(negative, Api::Generate), 0.0);
        assert_eq!(completion(br#"{"prompt":"p","max_tokens":-5}"#), 0.0);
    }

    #[test]
    fn resets_and_retries_read_as_openais() {
        assert_eq!(reset_text(Duration::from_millis(250)), "250ms");
        assert_eq!(reset_text(Duration::from_millis(1500)), "1.5s");
        assert_eq!(reset_text(Duration::from_secs(360)), "6m0s");
        assert_eq!(retry_after(Duration::from_millis(1200)), (2, 1200));
        assert_eq!(retry_after(Duration::ZERO), (1, 1));
    }
}
