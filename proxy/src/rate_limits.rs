//! The HTTP side of the tenants' limits (`pd_router::tenants`): what a request is charged, the
//! 429 a request over a limit gets, and the `x-ratelimit-*` headers OpenAI's clients read, on
//! the 429 and on every answer of a tenant with limits.
//!
//! A request is charged as OpenAI charges it: its prompt's tokens estimated from its size (a
//! quarter of the bytes of `prompt`, `messages`, `text` or `input_ids`), and its output tokens as
//! the most it may generate (`max_tokens`, `max_completion_tokens`, SGLang's `max_new_tokens`;
//! vLLM's default of 16 for a completion, [`UNBOUNDED_OUTPUT`] for a chat or `/generate` that
//! names no limit).

use std::time::Duration;

use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use pd_router::body::Body;
use pd_router::tenants::{LimitKind, Limited, RateStatus, Standing};

use crate::error::ApiError;
use crate::route::Route;

/// The output tokens charged to a chat or `/generate` request that names no limit.
pub(crate) const UNBOUNDED_OUTPUT: f64 = 1024.0;

/// vLLM's `max_tokens` of a completion that names none.
const COMPLETION_DEFAULT: f64 = 16.0;

/// A request's charge: (prompt tokens, estimated; output tokens, at most).
pub(crate) fn cost(route: Route, body: &Body<'_>) -> (f64, f64) {
    let size = |field: &str| body.get(field).map_or(0, |value| value.get().len());
    let prompt_bytes = size("prompt") + size("messages") + size("text") + size("input_ids");
    let number = |field: &str| {
        body.get(field)
            .and_then(|value| value.get().trim().parse::<f64>().ok())
            .filter(|n| n.is_finite() && *n >= 0.0)
    };
    let sampling_max = || {
        let params = body.get("sampling_params")?;
        let params: serde_json::Value = serde_json::from_str(params.get()).ok()?;
        params["max_new_tokens"].as_f64()
    };
    let output = match route {
        Route::Completions => number("max_tokens").unwrap_or(COMPLETION_DEFAULT),
        Route::ChatCompletions => (number("max_completion_tokens"))
            .or_else(|| number("max_tokens"))
            .unwrap_or(UNBOUNDED_OUTPUT),
        Route::Generate => sampling_max().unwrap_or(UNBOUNDED_OUTPUT),
    };
    ((prompt_bytes as f64 / 4.0).ceil(), output)
}

/// The 429 of a request over `limited`, its tenant `tenant`.
pub(crate) fn refusal(tenant: &str, limited: &Limited) -> Response {
    let kind = match limited.kind {
        LimitKind::Requests | LimitKind::Concurrency => "requests",
        LimitKind::PromptTokens | LimitKind::OutputTokens => "tokens",
    };
    let error = ApiError::new(StatusCode::TOO_MANY_REQUESTS, kind, limited.message(tenant))
        .with_code("rate_limit_exceeded");
    let mut response = error.into_response();
    let headers = response.headers_mut();
    if let Some(wait) = limited.retry_after {
        let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        headers.insert(RETRY_AFTER, HeaderValue::from(seconds.max(1)));
        let millis = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1);
        headers.insert(RETRY_AFTER_MS.clone(), HeaderValue::from(millis));
    }
    insert_status(headers, &limited.status);
    response
}

/// `retry-after-ms`: OpenAI's clients wait this long before their retry.
static RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

/// The `x-ratelimit-*` headers of `status`: `limit`, `remaining` and `reset` of the requests
/// (per second here, per minute at OpenAI) and of the tightest token limit (per minute).
pub(crate) fn insert_status(headers: &mut HeaderMap, status: &RateStatus) {
    let mut put = |family: &str, standing: &Standing| {
        let pairs = [
            ("limit", HeaderValue::from(standing.limit.floor() as u64)),
            (
                "remaining",
                HeaderValue::from(standing.remaining.floor() as u64),
            ),
            ("reset", reset_value(standing.reset)),
        ];
        for (what, value) in pairs {
            let name = format!("x-ratelimit-{what}-{family}");
            if let Ok(name) = HeaderName::try_from(name) {
                headers.insert(name, value);
            }
        }
    };
    if let Some(requests) = &status.requests {
        put("requests", requests);
    }
    if let Some(tokens) = &status.tokens {
        put("tokens", tokens);
    }
}

/// A reset time as OpenAI writes it: `250ms`, `1.5s`, `6m0s`.
fn reset_value(reset: Duration) -> HeaderValue {
    let millis = reset.as_millis();
    let text = if millis < 1000 {
        format!("{millis}ms")
    } else {
        let seconds = reset.as_secs_f64();
        let minutes = (seconds / 60.0).floor();
        let rest = ((seconds - minutes * 60.0) * 1000.0).round() / 1000.0;
        match minutes > 0.0 {
            true => format!("{minutes}m{rest}s"),
            false => format!("{rest}s"),
        }
    };
    HeaderValue::try_from(text).unwrap_or(HeaderValue::from_static("0s"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_charged_their_size_and_their_most_output() {
        let completion = br#"{"model":"m","prompt":"0123456789abcdef","max_tokens":40}"#;
        let body = Body::parse(completion).unwrap();
        assert_eq!(cost(Route::Completions, &body), (5.0, 40.0));
        let bare = Body::parse(br#"{"prompt":"hi"}"#).unwrap();
        assert_eq!(cost(Route::Completions, &bare).1, COMPLETION_DEFAULT);
        let chat = br#"{"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":7,"max_tokens":99}"#;
        assert_eq!(
            cost(Route::ChatCompletions, &Body::parse(chat).unwrap()).1,
            7.0
        );
        let unbounded = Body::parse(br#"{"messages":[]}"#).unwrap();
        assert_eq!(cost(Route::ChatCompletions, &unbounded).1, UNBOUNDED_OUTPUT);
        let generate = br#"{"text":"hello","sampling_params":{"max_new_tokens":12}}"#;
        assert_eq!(
            cost(Route::Generate, &Body::parse(generate).unwrap()),
            (2.0, 12.0)
        );
    }

    #[test]
    fn resets_read_as_openais() {
        let read = |d: Duration| reset_value(d).to_str().unwrap().to_owned();
        assert_eq!(read(Duration::from_millis(250)), "250ms");
        assert_eq!(read(Duration::from_millis(1500)), "1.5s");
        assert_eq!(read(Duration::from_secs(360)), "6m0s");
    }
}
