//! How a call to P or D failed, and what that says: retry on another decode, wake discovery,
//! or relay the backend's own message.

use std::time::Duration;

use bytes::Bytes;
use reqwest::header::HeaderValue;
use reqwest::StatusCode;

use crate::metrics::CallOutcome;

/// The most bytes of a backend's error answer kept (to relay it and look for an unknown engine).
pub(super) const MAX_ERROR_BODY: usize = 64 * 1024;

/// How a call to a backend failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum UpstreamError {
    /// No connection could be made.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The time limit passed.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// D sent no first byte within this long of P's answer (`--decode-first-byte-timeout`).
    #[error("no first byte within {0:?} of the prefill's answer")]
    FirstByteTimeout(Duration),
    /// An answer being streamed sent nothing for this long (`--decode-stall-timeout`).
    #[error("sent nothing for {0:?}")]
    Stalled(Duration),
    /// A non-2xx answer.
    #[error("answered {status}")]
    Status {
        /// The status.
        status: StatusCode,
        /// Its content type.
        content_type: Option<HeaderValue>,
        /// Its body (at most 64 KiB).
        body: Bytes,
    },
    /// The connection broke or the body could not be read.
    #[error("the answer broke off: {0}")]
    Broken(String),
}

impl UpstreamError {
    /// The metric outcome.
    pub(crate) fn outcome(&self) -> CallOutcome {
        match self {
            UpstreamError::Connect(_) => CallOutcome::ConnectError,
            UpstreamError::Timeout(_)
            | UpstreamError::FirstByteTimeout(_)
            | UpstreamError::Stalled(_) => CallOutcome::Timeout,
            UpstreamError::Status { .. } => CallOutcome::HttpError,
            UpstreamError::Broken(_) => CallOutcome::Error,
        }
    }

    /// Whether the backend went away while it worked on the request (its connection broke
    /// before the answer was complete): a decode may then have pulled the KV already.
    pub(crate) fn broke_while_working(&self) -> bool {
        matches!(self, UpstreamError::Broken(_))
    }

    /// Whether trying another decode may help: no connection, a broken answer, or a status
    /// that says "busy or broken" (408, 429, 5xx). A timeout is never retried: a call that
    /// already took all the time it had is not made again.
    pub(crate) fn retryable(&self) -> bool {
        match self {
            UpstreamError::Connect(_) | UpstreamError::Broken(_) => true,
            UpstreamError::Timeout(_)
            | UpstreamError::FirstByteTimeout(_)
            | UpstreamError::Stalled(_) => false,
            UpstreamError::Status { status, .. } => {
                status.is_server_error()
                    || *status == StatusCode::REQUEST_TIMEOUT
                    || *status == StatusCode::TOO_MANY_REQUESTS
            }
        }
    }

    /// Whether D's failure may come from a remote engine it could not find, so that the
    /// registry is worth asking: a 404 or a 500. vLLM 0.32 says no more than that: D's failed
    /// KV load is a generic `500 Internal server error` (whole answers) or a first SSE event
    /// carrying that error (streamed answers, see [`UpstreamError::from_stream_start`]);
    /// earlier releases said `remote engine_id X not found from bootstrap server Y`. An
    /// overloaded D's 503 or 429 is not asked about.
    pub(crate) fn may_be_unknown_engine(&self) -> bool {
        match self {
            UpstreamError::Status { status, .. } => {
                *status == StatusCode::NOT_FOUND || *status == StatusCode::INTERNAL_SERVER_ERROR
            }
            _ => false,
        }
    }

    /// The failure a streamed answer reports in its first event, before any token: vLLM
    /// answers 200 and then `data: {"error": {..., "code": 500}}` when the request fails
    /// after its stream began but before it produced anything (a failed KV load among
    /// others). Nothing has reached the client yet, so it is a failure like a 500 answer:
    /// retried, and relayed as OpenAI's JSON error with the event's code as status.
    pub(crate) fn from_stream_start(first: &[u8]) -> Option<Self> {
        let event = first.strip_prefix(b"data:")?.trim_ascii_start();
        if !event.starts_with(br#"{"error""#) {
            return None;
        }
        let event = event.split(|&b| b == b'\n').next()?.trim_ascii_end();
        let json: serde_json::Value = serde_json::from_slice(event).ok()?;
        let code = json
            .pointer("/error/code")
            .and_then(serde_json::Value::as_u64);
        let status = code
            .and_then(|code| StatusCode::from_u16(u16::try_from(code).ok()?).ok())
            .filter(|status| status.is_client_error() || status.is_server_error())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Some(UpstreamError::Status {
            status,
            content_type: Some(HeaderValue::from_static("application/json")),
            body: Bytes::copy_from_slice(event),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, body: &str) -> UpstreamError {
        UpstreamError::Status {
            status: StatusCode::from_u16(code).unwrap(),
            content_type: None,
            body: Bytes::from(body.to_owned()),
        }
    }

    /// What vLLM 0.32's D answers when the remote engine is not found (a whole answer, and
    /// the first bytes of a streamed one), as `examples/tests/real_vllm.rs` sees it.
    const VLLM_WHOLE: &str = r#"{"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":500}}"#;
    const VLLM_STREAM: &[u8] = b"data: {\"error\": {\"message\": \"Internal server error\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\ndata: [DONE]\n\n";

    #[test]
    fn failures_that_may_hide_an_unknown_engine() {
        assert!(status(404, "").may_be_unknown_engine());
        assert!(status(500, VLLM_WHOLE).may_be_unknown_engine());
        assert!(!status(503, "overloaded").may_be_unknown_engine());
        assert!(!status(400, "bad prompt").may_be_unknown_engine());
        assert!(!UpstreamError::Timeout(Duration::from_secs(1)).may_be_unknown_engine());
        assert!(!UpstreamError::Connect("refused".into()).may_be_unknown_engine());
    }

    #[test]
    fn a_stream_that_begins_with_an_error_is_a_failure() {
        let err = UpstreamError::from_stream_start(VLLM_STREAM).expect("an error event");
        assert!(err.may_be_unknown_engine() && err.retryable());
        let UpstreamError::Status { body, .. } = err else {
            unreachable!()
        };
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["error"]["code"], 500);
        let limited = br#"data: {"error": {"message": "slow down", "code": 429}}"#;
        assert!(matches!(
            UpstreamError::from_stream_start(limited),
            Some(UpstreamError::Status { status, .. }) if status == StatusCode::TOO_MANY_REQUESTS
        ));
        for tokens in [
            &br#"data: {"id":"cmpl-1","choices":[{"text":"error"}]}"#[..],
            b"data: [DONE]\n\n",
            b"{\"error\": \"not a stream\"}",
        ] {
            assert!(UpstreamError::from_stream_start(tokens).is_none());
        }
    }

    #[test]
    fn retryable_statuses() {
        for code in [408, 429, 500, 502, 503] {
            assert!(status(code, "").retryable(), "{code}");
        }
        for code in [400, 401, 404, 422] {
            assert!(!status(code, "").retryable(), "{code}");
        }
        assert!(UpstreamError::Connect("refused".into()).retryable());
        assert!(!UpstreamError::Timeout(Duration::from_secs(1)).retryable());
        assert!(!UpstreamError::FirstByteTimeout(Duration::from_secs(1)).retryable());
    }
}
