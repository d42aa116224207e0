//! Calling P and D: one shared HTTP client, each call counted on its backend until it ends.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::BoxStream;
use futures_util::StreamExt;
use reqwest::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use reqwest::{StatusCode, Url};

use crate::backend::Call;
use crate::config::Config;
use crate::metrics::CallOutcome;
use worker_client::service::error_chain;

/// The most bytes of a backend's error answer kept (to relay it and look for an unknown engine).
const MAX_ERROR_BODY: usize = 64 * 1024;

/// How a call to a backend failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No connection could be made.
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The time limit passed.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
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
    fn from_reqwest(err: &reqwest::Error, timeout: Duration) -> Self {
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
            UpstreamError::Timeout(_) => CallOutcome::Timeout,
            UpstreamError::Status { .. } => CallOutcome::HttpError,
            UpstreamError::Broken(_) => CallOutcome::Error,
        }
    }

    /// Whether trying another decode may help: no connection, a broken answer, or a status
    /// that says "busy or broken" (408, 429, 5xx). A timeout is not retried: the client already
    /// waited the whole request timeout.
    pub fn retryable(&self) -> bool {
        match self {
            UpstreamError::Connect(_) | UpstreamError::Broken(_) => true,
            UpstreamError::Timeout(_) => false,
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

/// A decode's answer whose status and first bytes arrived.
pub struct DecodeStart {
    /// D's status (2xx).
    pub status: StatusCode,
    /// D's content type.
    pub content_type: Option<HeaderValue>,
    /// The first chunk of the body (`None` for an empty body).
    pub first: Option<Bytes>,
    /// Whether `first` is the whole body (its length is what D announced).
    pub complete: bool,
    /// When the first chunk (or the end) arrived.
    pub first_at: Instant,
    /// The rest of the body.
    pub rest: BoxStream<'static, reqwest::Result<Bytes>>,
    /// The call, finished when the body ends.
    pub call: Call,
    /// D's time limit, for error messages.
    pub timeout: Duration,
}

/// The shared client and the time limits.
#[derive(Clone)]
pub struct Upstream {
    /// The pooled HTTP client every call uses (health checks and discovery too).
    pub client: reqwest::Client,
    /// Time limit of a call to P.
    pub prefill_timeout: Duration,
    /// Time limit of a call to D, streaming included.
    pub request_timeout: Duration,
}

impl Upstream {
    /// Builds the client: pooled keep-alive connections, TCP_NODELAY, no system proxy.
    pub fn new(config: &Config) -> reqwest::Result<Self> {
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(config.connect_timeout)
            .pool_idle_timeout(Duration::from_secs(60))
            .tcp_nodelay(true)
            .build()?;
        Ok(Upstream {
            client,
            prefill_timeout: config.prefill_timeout,
            request_timeout: config.request_timeout,
        })
    }

    /// Sends P its body and reads the whole answer, which must be 2xx.
    pub async fn prefill(
        &self,
        call: Call,
        url: Url,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<Bytes, UpstreamError> {
        let timeout = self.prefill_timeout;
        let result = async {
            let response = self
                .client
                .post(url)
                .headers(headers)
                .body(body)
                .timeout(timeout)
                .send()
                .await
                .map_err(|err| UpstreamError::from_reqwest(&err, timeout))?;
            let status = response.status();
            let content_type = response.headers().get(CONTENT_TYPE).cloned();
            let body = response
                .bytes()
                .await
                .map_err(|err| UpstreamError::from_reqwest(&err, timeout))?;
            if status.is_success() {
                Ok(body)
            } else {
                Err(UpstreamError::Status {
                    status,
                    content_type,
                    body: body.slice(..body.len().min(MAX_ERROR_BODY)),
                })
            }
        }
        .await;
        call.finish(match &result {
            Ok(_) => CallOutcome::Ok,
            Err(err) => err.outcome(),
        });
        result
    }

    /// Sends D its body and waits for the status and the first chunk of a 2xx answer (a non-2xx
    /// answer is read whole, up to 64 KiB, into the error).
    pub async fn decode(
        &self,
        call: Call,
        url: Url,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<DecodeStart, UpstreamError> {
        let timeout = self.request_timeout;
        let fail = |call: Call, err: UpstreamError| {
            call.finish(err.outcome());
            Err(err)
        };
        let response = match self
            .client
            .post(url)
            .headers(headers)
            .body(body)
            .timeout(timeout)
            .send()
            .await
        {
            Ok(response) => response,
            Err(err) => return fail(call, UpstreamError::from_reqwest(&err, timeout)),
        };
        let status = response.status();
        let content_type = response.headers().get(CONTENT_TYPE).cloned();
        let content_length = response.content_length();
        let mut stream = response.bytes_stream();
        if !status.is_success() {
            let mut body = Vec::new();
            while let Some(chunk) = stream.next().await {
                match chunk {
                    Ok(chunk) => {
                        body.extend_from_slice(
                            &chunk[..chunk.len().min(MAX_ERROR_BODY - body.len())],
                        );
                        if body.len() >= MAX_ERROR_BODY {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
            let err = UpstreamError::Status {
                status,
                content_type,
                body: Bytes::from(body),
            };
            return fail(call, err);
        }
        let first = loop {
            match stream.next().await {
                Some(Ok(chunk)) if chunk.is_empty() => continue,
                Some(Ok(chunk)) => break Some(chunk),
                Some(Err(err)) => return fail(call, UpstreamError::from_reqwest(&err, timeout)),
                None => break None,
            }
        };
        let complete = match (&first, content_length) {
            (None, _) => true,
            (Some(chunk), Some(length)) => chunk.len() as u64 == length,
            (Some(_), None) => false,
        };
        Ok(DecodeStart {
            status,
            content_type,
            first,
            complete,
            first_at: Instant::now(),
            rest: stream.boxed(),
            call,
            timeout,
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
