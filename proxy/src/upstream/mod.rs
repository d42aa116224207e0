//! Calling P and D over the proxy's own kept-alive connections (plain HTTP or TLS), each call
//! bounded by the request's deadline (P's also by the prefill timeout) and counted on its
//! backend until it ends (D's by the flow, which also holds it to its first-byte deadline).
//! reqwest's pooled client serves the rest: health checks, discovery, `/v1/models`.

mod answer;
mod connections;
mod error;
mod transport;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::Full;
use hyper::{Method, Request};
use reqwest::header::{HeaderMap, HeaderValue, CONTENT_TYPE, HOST};
use reqwest::StatusCode;
use tokio_rustls::TlsConnector;

pub(crate) use self::answer::Answer;
use self::answer::Head;
use self::connections::Connections;
pub(crate) use self::error::UpstreamError;
use crate::config::Config;
use crate::metrics::CallOutcome;
use pd_router::backend::Call;
use pd_router::endpoint::Endpoint;

/// How long an unused kept-alive connection to a backend stays open.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// A decode's answer whose status and first bytes arrived.
pub(crate) struct DecodeStart {
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
    /// The rest of the body, read until the request's deadline.
    pub rest: Answer,
}

/// The shared clients and the time limits.
#[derive(Clone)]
pub(crate) struct Upstream {
    /// The pooled HTTP client of health checks, discovery, `/v1/models` and HTTPS backends.
    pub client: reqwest::Client,
    /// The kept-alive connections of plain-HTTP calls to P and D.
    connections: Arc<Connections>,
    /// Time limit of a call to P.
    pub prefill_timeout: Duration,
    /// Time limit of a whole request, streaming included.
    pub request_timeout: Duration,
    /// Time limit of D's first byte, from P's answer.
    pub first_byte_timeout: Duration,
}

impl Upstream {
    /// Builds the clients: pooled keep-alive connections (idle ones closed after 60 s, kept
    /// apart for each of the `serving_threads`), TCP_NODELAY, the connect timeout, no system
    /// proxy. Starts the task that closes idle connections (it ends when the last clone of this
    /// is dropped).
    pub(crate) fn new(config: &Config, serving_threads: usize) -> reqwest::Result<Self> {
        let client = (config.router.upstream_tls.apply(reqwest::Client::builder()))
            .no_proxy()
            .connect_timeout(config.connect_timeout)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .tcp_nodelay(true)
            .build()?;
        let tls = TlsConnector::from(config.router.upstream_tls.rustls_http1());
        let connections = Connections::new(
            tls,
            config.connect_timeout,
            POOL_IDLE_TIMEOUT,
            serving_threads,
        );
        tokio::spawn(Connections::sweep_forever(
            Arc::downgrade(&connections),
            POOL_IDLE_TIMEOUT / 4,
        ));
        Ok(Upstream {
            client,
            connections,
            prefill_timeout: config.prefill_timeout,
            request_timeout: config.request_timeout,
            first_byte_timeout: config.decode_first_byte_timeout,
        })
    }

    /// POSTs `body` to `endpoint` and waits for the head of the answer; the body is then read
    /// until the same deadline, `due` (`timeout` is the limit that set it, for messages).
    async fn post(
        &self,
        endpoint: &Endpoint,
        headers: HeaderMap,
        body: Bytes,
        due: Instant,
        timeout: Duration,
    ) -> Result<Head, UpstreamError> {
        let mut deadline = Box::pin(tokio::time::sleep_until(due.into()));
        let sending = async {
            let target = endpoint.target();
            let mut request = Request::new(Full::new(body));
            *request.method_mut() = Method::POST;
            *request.uri_mut() = target.origin.clone();
            *request.headers_mut() = headers;
            request.headers_mut().insert(HOST, target.host.clone());
            let response = self.connections.send(target, request).await?;
            let status = response.status();
            let content_type = response.headers().get(CONTENT_TYPE).cloned();
            let body = response.into_body();
            let content_length = body.exact_length();
            Ok::<_, UpstreamError>((status, content_type, content_length, body))
        };
        let (status, content_type, content_length, body) = tokio::select! {
            biased;
            sent = sending => sent?,
            () = &mut deadline => return Err(UpstreamError::Timeout(timeout)),
        };
        Ok(Head {
            status,
            content_type,
            content_length,
            body: Answer {
                body,
                deadline,
                due,
                timeout,
                silence: None,
            },
        })
    }

    /// Sends P its body and reads the whole answer, which must be 2xx, within the prefill
    /// timeout and before the request's `deadline`.
    pub(crate) async fn prefill(
        &self,
        call: Call,
        endpoint: &Endpoint,
        headers: HeaderMap,
        body: Bytes,
        deadline: Instant,
    ) -> Result<Bytes, UpstreamError> {
        let frozen_at = Instant::now() + self.prefill_timeout;
        let (due, limit) = if frozen_at <= deadline {
            (frozen_at, self.prefill_timeout)
        } else {
            (deadline, self.request_timeout)
        };
        let result = async {
            let mut head = self.post(endpoint, headers, body, due, limit).await?;
            if head.status.is_success() {
                head.body.whole(usize::MAX).await
            } else {
                Err(head.body.into_error(head.status, head.content_type).await)
            }
        }
        .await;
        if let Err(UpstreamError::Timeout(limit)) = &result {
            if due == frozen_at {
                // P only computes the prompt: one that takes this long is frozen, not busy.
                call.backend()
                    .eject(&format!("prefill did not answer within {limit:?}"));
            }
        }
        call.finish(match &result {
            Ok(_) => CallOutcome::Ok,
            Err(err) => err.outcome(),
        });
        result
    }

    /// Sends D its body and waits for the status and the first chunk of a 2xx answer (a non-2xx
    /// answer is read whole, up to 64 KiB, into the error), all of it, the rest of the body
    /// included, before the request's `deadline`.
    pub(crate) async fn decode(
        &self,
        endpoint: &Endpoint,
        headers: HeaderMap,
        body: Bytes,
        deadline: Instant,
    ) -> Result<DecodeStart, UpstreamError> {
        let Head {
            status,
            content_type,
            content_length,
            body: mut rest,
        } = self
            .post(endpoint, headers, body, deadline, self.request_timeout)
            .await?;
        if !status.is_success() {
            return Err(rest.into_error(status, content_type).await);
        }
        let first = loop {
            match rest.next().await.transpose()? {
                Some(chunk) if chunk.is_empty() => continue,
                chunk => break chunk,
            }
        };
        if let Some(err) = first.as_deref().and_then(UpstreamError::from_stream_start) {
            return Err(err);
        }
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
        })
    }
}
