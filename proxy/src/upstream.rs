//! Calling P and D: one shared HTTP client, each call counted on its backend until it ends.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::stream::{BoxStream, Stream};
use futures_util::StreamExt;
use http_body_util::Full;
use hyper::body::{Body as _, Incoming};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use reqwest::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use reqwest::{StatusCode, Url};
use tokio::time::Sleep;

use crate::backend::Call;
use crate::config::Config;
use crate::metrics::CallOutcome;
use pd_service::error_chain;

/// The most bytes of a backend's error answer kept (to relay it and look for an unknown engine).
const MAX_ERROR_BODY: usize = 64 * 1024;

/// How long an unused kept-alive connection to a backend stays open.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

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

/// Where a call to a backend goes. Plain-HTTP endpoints are called with a bare hyper client
/// (their URI is parsed once here); HTTPS ones through reqwest, for its TLS.
#[derive(Debug, Clone)]
pub struct Endpoint {
    url: Url,
    plain: Option<Uri>,
}

impl Endpoint {
    /// The endpoint at `url`.
    pub fn new(url: Url) -> Self {
        let plain = (url.scheme() == "http")
            .then(|| Uri::try_from(url.as_str()).expect("a parsed http URL is a valid URI"));
        Endpoint { url, plain }
    }

    /// Its URL.
    pub fn url(&self) -> &Url {
        &self.url
    }
}

/// The body of a backend's answer, read under the call's time limit.
pub struct Answer {
    source: Source,
    deadline: Pin<Box<Sleep>>,
    timeout: Duration,
}

enum Source {
    Plain(Incoming),
    Tls(BoxStream<'static, reqwest::Result<Bytes>>),
}

impl Stream for Answer {
    type Item = Result<Bytes, UpstreamError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let timeout = this.timeout;
        let polled = match &mut this.source {
            Source::Plain(body) => loop {
                match Pin::new(&mut *body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        Ok(data) => break Poll::Ready(Some(Ok(data))),
                        // Trailers carry nothing to relay.
                        Err(_) => continue,
                    },
                    Poll::Ready(Some(Err(err))) => {
                        break Poll::Ready(Some(Err(UpstreamError::Broken(error_chain(&err)))))
                    }
                    Poll::Ready(None) => break Poll::Ready(None),
                    Poll::Pending => break Poll::Pending,
                }
            },
            Source::Tls(stream) => stream.poll_next_unpin(cx).map(|item| {
                item.map(|chunk| chunk.map_err(|err| UpstreamError::from_reqwest(&err, timeout)))
            }),
        };
        if polled.is_pending() && this.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(UpstreamError::Timeout(timeout))));
        }
        polled
    }
}

impl Answer {
    /// Reads the rest of the body into one buffer (no copy when it is one chunk).
    async fn whole(&mut self, limit: usize) -> Result<Bytes, UpstreamError> {
        let Some(first) = self.next().await.transpose()? else {
            return Ok(Bytes::new());
        };
        let mut whole: Option<BytesMut> = None;
        while let Some(chunk) = self.next().await.transpose()? {
            let buffer = whole.get_or_insert_with(|| BytesMut::from(&first[..]));
            buffer.extend_from_slice(&chunk[..chunk.len().min(limit.saturating_sub(buffer.len()))]);
            if buffer.len() >= limit {
                break;
            }
        }
        Ok(match whole {
            Some(buffer) => buffer.freeze(),
            None => first,
        })
    }

    /// A non-2xx answer, read whole (up to 64 KiB), as the error it is.
    async fn into_error(
        mut self,
        status: StatusCode,
        content_type: Option<HeaderValue>,
    ) -> UpstreamError {
        let body = self.whole(MAX_ERROR_BODY).await.unwrap_or_default();
        UpstreamError::Status {
            status,
            content_type,
            body: body.slice(..body.len().min(MAX_ERROR_BODY)),
        }
    }
}

/// The head of a backend's answer, with its body still to read.
struct Head {
    status: StatusCode,
    content_type: Option<HeaderValue>,
    content_length: Option<u64>,
    body: Answer,
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
    pub rest: Answer,
    /// The call, finished when the body ends.
    pub call: Call,
}

/// The HTTP/1 client plain-HTTP calls to P and D use.
type PlainClient = Client<HttpConnector, Full<Bytes>>;

/// The shared clients and the time limits.
#[derive(Clone)]
pub struct Upstream {
    /// The pooled HTTP client of health checks, discovery, `/v1/models` and HTTPS backends.
    pub client: reqwest::Client,
    plain: PlainClient,
    /// Time limit of a call to P.
    pub prefill_timeout: Duration,
    /// Time limit of a call to D, streaming included.
    pub request_timeout: Duration,
}

impl Upstream {
    /// Builds the clients: pooled keep-alive connections (idle ones closed after 60 s),
    /// TCP_NODELAY, the connect timeout, no system proxy.
    pub fn new(config: &Config) -> reqwest::Result<Self> {
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(config.connect_timeout)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .tcp_nodelay(true)
            .build()?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(config.connect_timeout));
        let plain = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_timer(TokioTimer::new())
            .build(connector);
        Ok(Upstream {
            client,
            plain,
            prefill_timeout: config.prefill_timeout,
            request_timeout: config.request_timeout,
        })
    }

    /// POSTs `body` to `endpoint` and waits for the head of the answer; the body is then read
    /// under the same time limit.
    async fn post(
        &self,
        endpoint: &Endpoint,
        headers: HeaderMap,
        body: Bytes,
        timeout: Duration,
    ) -> Result<Head, UpstreamError> {
        let mut deadline = Box::pin(tokio::time::sleep(timeout));
        let sending = async {
            match &endpoint.plain {
                Some(uri) => {
                    let mut request = Request::new(Full::new(body));
                    *request.method_mut() = Method::POST;
                    *request.uri_mut() = uri.clone();
                    *request.headers_mut() = headers;
                    let response = self.plain.request(request).await.map_err(|err| {
                        if err.is_connect() {
                            UpstreamError::Connect(error_chain(&err))
                        } else {
                            UpstreamError::Broken(error_chain(&err))
                        }
                    })?;
                    let status = response.status();
                    let content_type = response.headers().get(CONTENT_TYPE).cloned();
                    let body = response.into_body();
                    let content_length = body.size_hint().exact();
                    Ok((status, content_type, content_length, Source::Plain(body)))
                }
                None => {
                    let response = self
                        .client
                        .post(endpoint.url.clone())
                        .headers(headers)
                        .body(body)
                        .send()
                        .await
                        .map_err(|err| UpstreamError::from_reqwest(&err, timeout))?;
                    let status = response.status();
                    let content_type = response.headers().get(CONTENT_TYPE).cloned();
                    let content_length = response.content_length();
                    Ok((
                        status,
                        content_type,
                        content_length,
                        Source::Tls(response.bytes_stream().boxed()),
                    ))
                }
            }
        };
        let (status, content_type, content_length, source) = tokio::select! {
            biased;
            sent = sending => sent?,
            () = &mut deadline => return Err(UpstreamError::Timeout(timeout)),
        };
        Ok(Head {
            status,
            content_type,
            content_length,
            body: Answer {
                source,
                deadline,
                timeout,
            },
        })
    }

    /// Sends P its body and reads the whole answer, which must be 2xx.
    pub async fn prefill(
        &self,
        call: Call,
        endpoint: &Endpoint,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<Bytes, UpstreamError> {
        let result = async {
            let mut head = self
                .post(endpoint, headers, body, self.prefill_timeout)
                .await?;
            if head.status.is_success() {
                head.body.whole(usize::MAX).await
            } else {
                Err(head.body.into_error(head.status, head.content_type).await)
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
        endpoint: &Endpoint,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<DecodeStart, UpstreamError> {
        let fail = |call: Call, err: UpstreamError| {
            call.finish(err.outcome());
            Err(err)
        };
        let Head {
            status,
            content_type,
            content_length,
            body: mut rest,
        } = match self
            .post(endpoint, headers, body, self.request_timeout)
            .await
        {
            Ok(head) => head,
            Err(err) => return fail(call, err),
        };
        if !status.is_success() {
            let err = rest.into_error(status, content_type).await;
            return fail(call, err);
        }
        let first = loop {
            match rest.next().await {
                Some(Ok(chunk)) if chunk.is_empty() => continue,
                Some(Ok(chunk)) => break Some(chunk),
                Some(Err(err)) => return fail(call, err),
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
            rest,
            call,
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
