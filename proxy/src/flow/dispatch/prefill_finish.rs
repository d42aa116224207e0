//! Whether P's answer ended on its length cap. vLLM's connectors (Mooncake and NIXL) send the
//! KV only for a request that ends there (`FINISHED_LENGTH_CAPPED`): a P that ends "stopped"
//! (an engine that ignores the `min_tokens: 1` P is sent, so that its one token could be EOS or
//! a stop token) sent nothing, and a D waiting for that KV would wait until its own timeout.

use std::borrow::Cow;

use serde::Deserialize;

use crate::metrics::RouteMetrics;
use pd_router::backend::{Backend, Pair};

/// The one part of P's OpenAI answer read here, borrowed from it.
#[derive(Deserialize)]
struct Answer<'a> {
    #[serde(default, borrow)]
    choices: Vec<Choice<'a>>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(default, borrow)]
    finish_reason: Option<Cow<'a, str>>,
}

/// The finish reason of the first choice of P's answer that did not end on its length cap
/// (`none` for one without a reason), if one did not; `None` for an answer that did, or one
/// that cannot be read (no evidence that the KV was dropped: D's own limits then apply).
pub(super) fn stopped_before_cap(answer: &[u8]) -> Option<String> {
    let answer: Answer<'_> = serde_json::from_slice(answer).ok()?;
    answer
        .choices
        .into_iter()
        .find_map(|choice| match choice.finish_reason.as_deref() {
            Some("length") => None,
            Some(reason) => Some(reason.to_owned()),
            None => Some("none".to_owned()),
        })
}

/// Tells (a warning, the route's `prefill_stopped_total`) that `pair`'s P ended with `reason`
/// before its cap, so that `decode` serves the request alone.
pub(super) fn prefill_stopped(metrics: &RouteMetrics, pair: &Pair, decode: &Backend, reason: &str) {
    tracing::warn!(
        prefill = pair.backend.url(),
        dp_rank = pair.dp_rank,
        decode = decode.url(),
        finish_reason = reason,
        "the prefill ended before its one-token cap and so sent no KV (does it ignore \
         min_tokens?): the decode serves the request alone"
    );
    metrics.prefill_stopped();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_answer_that_ended_short_of_its_cap_is_named() {
        let capped = br#"{"choices":[{"index":0,"text":" a","finish_reason":"length"}],
                          "kv_transfer_params":{"remote_block_ids":[1]}}"#;
        assert_eq!(stopped_before_cap(capped), None);
        let stopped =
            br#"{"choices":[{"index":0,"message":{"content":""},"finish_reason":"stop"}]}"#;
        assert_eq!(stopped_before_cap(stopped).as_deref(), Some("stop"));
        let second = br#"{"choices":[{"finish_reason":"length"},{"finish_reason":"abort"}]}"#;
        assert_eq!(stopped_before_cap(second).as_deref(), Some("abort"));
        let unfinished = br#"{"choices":[{"finish_reason":null}]}"#;
        assert_eq!(stopped_before_cap(unfinished).as_deref(), Some("none"));
        // Nothing to go on: no verdict.
        for unread in [
            &b"not json"[..],
            br#"{"object":"x"}"#,
            br#"{"choices":"x"}"#,
        ] {
            assert_eq!(stopped_before_cap(unread), None);
        }
    }
}
