//! How a call to P or D failed, and what that says: retry on another decode, wake discovery,
//! or relay the backend's own message.

use std::time::Duration;

use bytes::Bytes;
use pd_service::error_chain;
use reqwest::header::HeaderValue;
use reqwest::StatusCode;

use crate::metrics::CallOutcome;

/// The most bytes of a backend's error answer kept (to relay it and look for an unknown engine).
pub(super) const MAX_ERROR_BODY: usize = 64 * 1024;

/// How a call to a backend failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No connection could be made.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The time limit passed.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// D sent no first byte within this long of P's answer (`--decode-first-byte-timeout`).
    #[error("no first byte within {0:?} of the prefill's answer")]
    FirstByteTimeout(Duration),
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
    pub(super) fn from_reqwest(err: &reqwest::Error, timeout: Duration) -> Self {
        if err.is_timeout() {
            UpstreamError::Timeout(timeout)
        } else if err.is_connect() {
            UpstreamError::Connect(error_chain(err))
        } else {
            UpstreamError::Broken(error_chain(err))
        }
    }

    /// The metric outcome.
    pub fn outcome(&self) -> CallOutcome {
        match self {
            UpstreamError::Connect(_) => CallOutcome::ConnectError,
            UpstreamError::Timeout(_) | UpstreamError::FirstByteTimeout(_) => CallOutcome::Timeout,
            UpstreamError::Status { .. } => CallOutcome::HttpError,
            UpstreamError::Broken(_) => CallOutcome::Error,
        }
    }

    /// Whether trying another decode may help: no connection, a broken answer, or a status
    /// that says "busy or broken" (408, 429, 5xx). A timeout is never retried: a call that
    /// already took all the time it had is not made again.
    pub fn retryable(&self) -> bool {
        match self {
            UpstreamError::Connect(_) | UpstreamError::Broken(_) => true,
            UpstreamError::Timeout(_) | UpstreamError::FirstByteTimeout(_) => false,
            UpstreamError::Status { status, .. } => {
                status.is_server_error()
                    || *status == StatusCode::REQUEST_TIMEOUT
                    || *status == StatusCode::TOO_MANY_REQUESTS
            }
        }
    }

    /// Whether D's answer says it could not find the remote engine on the bootstrap server
    /// (vLLM: `remote engine_id X not found from bootstrap server Y`), or is a 404.
    pub fn is_unknown_engine(&self) -> bool {
        match self {
            UpstreamError::Status { status, body, .. } => {
                *status == StatusCode::NOT_FOUND || {
                    let text = String::from_utf8_lossy(body);
                    text.contains("not found from bootstrap server")
                        || (text.contains("engine_id") && text.contains("not found"))
                }
            }
            _ => false,
        }
    }

    /// The message in a backend's error body: OpenAI's `error.message`, FastAPI's `detail`, or
    /// the text itself.
    pub fn backend_message(&self) -> String {
        match self {
            UpstreamError::Status { status, body, .. } => {
                let message = serde_json::from_slice::<serde_json::Value>(body)
                    .ok()
                    .and_then(|json| {
                        json.pointer("/error/message")
                            .or_else(|| json.get("detail"))
                            .or_else(|| json.get("message"))
                            .map(|value| match value.as_str() {
                                Some(text) => text.to_owned(),
                                None => value.to_string(),
                            })
                    })
                    .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_owned());
                if message.is_empty() {
                    format!("answered {status}")
                } else {
                    format!("answered {status}: {message}")
                }
            }
            other => other.to_string(),
        }
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

    #[test]
    fn unknown_engines_are_recognized() {
        assert!(status(404, "").is_unknown_engine());
        assert!(status(
            500,
            r#"{"error":{"message":"remote engine_id e1 not found from bootstrap server http://h:8998"}}"#
        )
        .is_unknown_engine());
        assert!(!status(500, "out of memory").is_unknown_engine());
        assert!(!UpstreamError::Timeout(Duration::from_secs(1)).is_unknown_engine());
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

    #[test]
    fn backend_messages_are_extracted() {
        assert_eq!(
            status(
                400,
                r#"{"error":{"message":"too long","type":"BadRequestError"}}"#
            )
            .backend_message(),
            "answered 400 Bad Request: too long"
        );
        assert_eq!(
            status(500, r#"{"detail":"boom"}"#).backend_message(),
            "answered 500 Internal Server Error: boom"
        );
        assert_eq!(
            status(503, "").backend_message(),
            "answered 503 Service Unavailable"
        );
    }
}
