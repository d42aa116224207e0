//! [`BootstrapClientBuilder`]: a client's settings, each with a production default.

use std::time::Duration;

use super::{BootstrapClient, Settings};
use crate::error::ClientError;
use crate::retry::RetryPolicy;
use crate::tls::ClientTls;

/// Builds a [`BootstrapClient`]; every setting has a production default.
///
/// ```no_run
/// # async fn demo() -> Result<(), worker_client::ClientError> {
/// use std::time::Duration;
/// let client = worker_client::BootstrapClient::builder("http://10.0.0.5:8998")
///     .request_timeout(Duration::from_secs(2))
///     .register_deadline(Duration::from_secs(300))
///     .token("s3cret")
///     .build()?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct BootstrapClientBuilder {
    url: String,
    connect_timeout: Duration,
    settings: Settings,
    tls: ClientTls,
}

impl BootstrapClientBuilder {
    /// Time allowed to open a TCP connection (default 3 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Time allowed for one attempt of one call, connection included (default 5 s).
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.settings.request_timeout = timeout;
        self
    }

    /// How long [`BootstrapClient::register_worker`] keeps retrying (default 10 minutes: rank 0
    /// may start long after the other workers).
    pub fn register_deadline(mut self, deadline: Duration) -> Self {
        self.settings.register_deadline = deadline;
        self
    }

    /// How long every other retried call keeps trying (default 30 s).
    pub fn call_deadline(mut self, deadline: Duration) -> Self {
        self.settings.call_deadline = deadline;
        self
    }

    /// How long one `GET /watch` long poll waits for a change (default 20 s; the server caps it
    /// at 25 s, or five sixths of its `--request-timeout` when that is shorter than 30 s). Its
    /// HTTP timeout is this wait plus the request timeout.
    pub fn watch_wait(mut self, wait: Duration) -> Self {
        self.settings.watch_wait = wait;
        self
    }

    /// The backoff between retries.
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.settings.retry = policy;
        self
    }

    /// The bearer token the server's write routes require (`--auth-token`).
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.settings.token = Some(token.into()).filter(|t| !t.is_empty());
        self
    }

    /// The CA bundle and client certificate of an `https://` server (see [`ClientTls`]).
    pub fn tls(mut self, tls: ClientTls) -> Self {
        self.tls = tls;
        self
    }

    /// Checks the URL and builds the client.
    pub fn build(self) -> Result<BootstrapClient, ClientError> {
        let base = normalize_url(&self.url)?;
        let http = (self.tls.apply(reqwest::Client::builder()))
            .connect_timeout(self.connect_timeout)
            .timeout(self.settings.request_timeout)
            .pool_idle_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| ClientError::InvalidUrl {
                url: self.url.clone(),
                reason: format!("cannot build an HTTP client: {e}"),
            })?;
        Ok(BootstrapClient {
            http,
            base,
            settings: self.settings,
        })
    }
}

impl BootstrapClient {
    /// A builder for the server at `url` (e.g. `http://10.0.0.5:8998`).
    pub fn builder(url: impl Into<String>) -> BootstrapClientBuilder {
        BootstrapClientBuilder {
            url: url.into(),
            connect_timeout: Duration::from_secs(3),
            tls: ClientTls::default(),
            settings: Settings {
                request_timeout: Duration::from_secs(5),
                register_deadline: Duration::from_secs(600),
                call_deadline: Duration::from_secs(30),
                watch_wait: Duration::from_secs(20),
                retry: RetryPolicy::default(),
                token: None,
            },
        }
    }
}

/// Checks that `url` is an http(s) URL with a host and returns it without a trailing slash.
pub(crate) fn normalize_url(url: &str) -> Result<String, ClientError> {
    let invalid = |reason: &str| ClientError::InvalidUrl {
        url: url.to_owned(),
        reason: reason.to_owned(),
    };
    let parsed = url::Url::parse(url).map_err(|e| invalid(&e.to_string()))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(invalid("the scheme must be http or https"));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(invalid("the URL has no host"));
    }
    Ok(url.trim_end_matches('/').to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked_and_normalized() {
        assert_eq!(normalize_url("http://h:8998/").unwrap(), "http://h:8998");
        assert!(normalize_url("tcp://h:8998").is_err());
        assert!(normalize_url("h:8998").is_err());
        assert!(normalize_url("").is_err());
    }
}
