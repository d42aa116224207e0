//! [`BootstrapClient`]: every call a worker or an operator makes to one bootstrap server.
//!
//! This file holds the client and how one call is made (an attempt under a timeout, the answer
//! or the error it stands for); the calls themselves are grouped by what they are about:
//! `workers.rs` (registration, leases, the topology, readiness), `requests.rs` (request ids);
//! `builder.rs` makes a client.

mod builder;
mod requests;
mod workers;

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;

pub(crate) use self::builder::normalize_url;
pub use self::builder::BootstrapClientBuilder;
pub use self::requests::RequestOutcome;
use crate::error::ClientError;
use crate::retry::RetryPolicy;
use pd_protocol::ErrorBody;
use pd_service::error_chain;

/// Settings shared by every call of a client.
#[derive(Debug, Clone)]
struct Settings {
    request_timeout: Duration,
    register_deadline: Duration,
    call_deadline: Duration,
    watch_wait: Duration,
    retry: RetryPolicy,
    token: Option<String>,
}

/// A client of one bootstrap server. Cheap to clone (clones share the connection pool).
///
/// Every call has a per-attempt timeout, and every retrying call a deadline: nothing waits
/// without a bound.
#[derive(Debug, Clone)]
pub struct BootstrapClient {
    http: reqwest::Client,
    base: String,
    settings: Settings,
}

impl BootstrapClient {
    /// A client with default settings for the server at `url`.
    pub fn new(url: &str) -> Result<Self, ClientError> {
        Self::builder(url).build()
    }

    /// The same client (settings, connection pool) pointed at another server.
    pub fn at(&self, url: &str) -> Result<Self, ClientError> {
        Ok(BootstrapClient {
            http: self.http.clone(),
            base: normalize_url(url)?,
            settings: self.settings.clone(),
        })
    }

    /// The server's base URL.
    pub fn url(&self) -> &str {
        &self.base
    }

    /// The deadline of retried calls other than registration.
    pub fn call_deadline(&self) -> Duration {
        self.settings.call_deadline
    }

    /// The deadline of registrations, retries included.
    pub(crate) fn register_deadline(&self) -> Duration {
        self.settings.register_deadline
    }

    /// The time allowed for one attempt of one call.
    pub(crate) fn request_timeout(&self) -> Duration {
        self.settings.request_timeout
    }

    /// The backoff between retries.
    pub(crate) fn retry_policy(&self) -> RetryPolicy {
        self.settings.retry
    }

    /// One attempt of one call, allowed `timeout` (connection included): the status and the
    /// whole body, or the transport failure.
    pub(crate) async fn send<B: Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Duration,
    ) -> Result<(StatusCode, bytes::Bytes), ClientError> {
        let reply = self.send_reply(method, path, body, timeout).await?;
        Ok((reply.status, reply.body))
    }

    /// [`Self::send`], with the answer's `Retry-After` (whole seconds) too.
    pub(crate) async fn send_reply<B: Serialize + ?Sized>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Duration,
    ) -> Result<Reply, ClientError> {
        let url = format!("{}{path}", self.base);
        let mut request = self.http.request(method, &url).timeout(timeout);
        if let Some(token) = &self.settings.token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let transport = |err: reqwest::Error| {
            if err.is_timeout() {
                ClientError::Timeout {
                    url: url.clone(),
                    timeout,
                }
            } else if err.is_connect() {
                ClientError::Connect {
                    url: url.clone(),
                    reason: error_chain(&err),
                }
            } else {
                ClientError::Transport {
                    url: url.clone(),
                    reason: error_chain(&err),
                }
            }
        };
        let response = request.send().await.map_err(transport)?;
        let status = response.status();
        let retry_after = (response.headers().get(reqwest::header::RETRY_AFTER))
            .and_then(|value| value.to_str().ok()?.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let body = response.bytes().await.map_err(transport)?;
        Ok(Reply {
            status,
            retry_after,
            body,
        })
    }

    /// One attempt of one call, allowed `timeout` (connection included). A 503 answer whose body
    /// parses as `T` is returned like a success.
    async fn call<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Duration,
    ) -> Result<(StatusCode, T), ClientError> {
        let (status, bytes) = self.send(method, path, body, timeout).await?;
        if status.is_success() || status == StatusCode::SERVICE_UNAVAILABLE {
            if let Ok(value) = serde_json::from_slice::<T>(&bytes) {
                return Ok((status, value));
            }
        }
        Err(self.answer_error(path, status, &bytes))
    }

    /// The error an answer that is not the expected one stands for: a 2xx whose body did not
    /// parse, a retryable 5xx/408/429, or a rejection, each with the server's message (its JSON
    /// `detail`, else the first 500 characters of the body).
    pub(crate) fn answer_error(&self, path: &str, status: StatusCode, body: &[u8]) -> ClientError {
        let url = format!("{}{path}", self.base);
        let detail = serde_json::from_slice::<ErrorBody>(body)
            .map(|e| e.detail)
            .unwrap_or_else(|_| String::from_utf8_lossy(body).chars().take(500).collect());
        let code = status.as_u16();
        if status.is_success() {
            ClientError::InvalidResponse {
                url,
                reason: format!("unexpected body: {detail}"),
            }
        } else if status.is_server_error()
            || status == StatusCode::REQUEST_TIMEOUT
            || status == StatusCode::TOO_MANY_REQUESTS
        {
            ClientError::Unavailable {
                url,
                status: code,
                detail,
            }
        } else {
            ClientError::Rejected {
                url,
                status: code,
                detail,
            }
        }
    }

    /// One attempt of a call whose success is a 2xx (a 503 body is an error even if it parses),
    /// allowed the request timeout.
    async fn call_ok<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ClientError> {
        self.call_ok_within(method, path, body, self.settings.request_timeout)
            .await
    }

    /// [`Self::call_ok`] allowed `timeout` instead of the request timeout (long polls).
    async fn call_ok_within<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        timeout: Duration,
    ) -> Result<T, ClientError> {
        match self
            .call::<B, serde_json::Value>(method, path, body, timeout)
            .await?
        {
            (status, value) if status.is_success() => {
                serde_json::from_value(value).map_err(|e| ClientError::InvalidResponse {
                    url: format!("{}{path}", self.base),
                    reason: e.to_string(),
                })
            }
            (status, value) => Err(ClientError::Unavailable {
                url: format!("{}{path}", self.base),
                status: status.as_u16(),
                detail: value["detail"].as_str().unwrap_or_default().to_owned(),
            }),
        }
    }
}

/// One answer: its status, its `Retry-After` and its whole body.
pub(crate) struct Reply {
    pub(crate) status: StatusCode,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) body: bytes::Bytes,
}

/// Percent-encodes everything but unreserved characters, for ids in paths and queries.
fn percent_encode(text: &str) -> String {
    url::form_urlencoded::byte_serialize(text.as_bytes())
        .collect::<String>()
        .replace('+', "%20")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_encoded_for_paths() {
        assert_eq!(percent_encode("a b/c?d"), "a%20b%2Fc%3Fd");
        assert_eq!(percent_encode("xfer-1"), "xfer-1");
    }
}
