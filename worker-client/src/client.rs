//! [`BootstrapClient`]: every call a worker or an operator makes to one bootstrap server.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::ClientError;
use crate::retry::RetryPolicy;
use pd_protocol::native::{
    Deregister, DeregisterResponse, DrainResponse, LeaseStatus, ReadyStatus, ReleaseResponse,
    RevokeResponse, WatchBatch, WorkerList,
};
use pd_protocol::vllm::{
    QueryRequests, QueryRequestsResponse, RegisterRequest, RegisterResponse, RegisterWorker,
    RequestLocation, Topology, MAX_QUERY_IDS,
};
use pd_protocol::{ErrorBody, LeaseId, Rank, Revision, Status};
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
    /// at 25 s). Its HTTP timeout is this wait plus the request timeout.
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

    /// Checks the URL and builds the client.
    pub fn build(self) -> Result<BootstrapClient, ClientError> {
        let base = normalize_url(&self.url)?;
        let http = reqwest::Client::builder()
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

/// What became of one request id asked about with [`BootstrapClient::query_requests`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestOutcome {
    /// The P worker addresses (one per pp rank) holding D's share of the KV.
    Ready(Vec<String>),
    /// The server knows the id but cannot serve it; the text says why.
    Failed(String),
    /// P had not registered the id before the deadline.
    TimedOut,
}

impl From<RequestOutcome> for RequestLocation {
    fn from(outcome: RequestOutcome) -> Self {
        match outcome {
            RequestOutcome::Ready(addrs) => RequestLocation::Ok(addrs),
            RequestOutcome::Failed(text) => RequestLocation::Error(text),
            RequestOutcome::TimedOut => RequestLocation::Retry,
        }
    }
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
    /// A builder for the server at `url` (e.g. `http://10.0.0.5:8998`).
    pub fn builder(url: impl Into<String>) -> BootstrapClientBuilder {
        BootstrapClientBuilder {
            url: url.into(),
            connect_timeout: Duration::from_secs(3),
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
        let bytes = response.bytes().await.map_err(transport)?;
        Ok((status, bytes))
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

    /// Registers one P worker (`POST /register`), retrying connection failures, timeouts and
    /// 5xx/503 with backoff until the register deadline. A conflict (4xx) is returned at once as
    /// [`ClientError::Rejected`] with the server's text. Registration is idempotent, so retries
    /// are safe. The answer carries the lease when `worker.lease_ttl` asked for one; to keep a
    /// lease alive, use [`BootstrapClient::register_leased`] instead.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), worker_client::ClientError> {
    /// use worker_client::{protocol::vllm::RegisterWorker, BootstrapClient};
    /// let client = BootstrapClient::new("http://10.0.0.5:8998")?;
    /// client
    ///     .register_worker(&RegisterWorker {
    ///         engine_id: "engine-7f3a".into(),
    ///         dp_rank: 0,
    ///         tp_rank: 1,
    ///         pp_rank: 0,
    ///         addr: "tcp://10.0.0.5:41232".into(),
    ///         ..RegisterWorker::default()
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(skip_all, fields(url = %self.base, engine_id = %worker.engine_id, dp = worker.dp_rank, tp = worker.tp_rank, pp = worker.pp_rank))]
    pub async fn register_worker(
        &self,
        worker: &RegisterWorker,
    ) -> Result<RegisterResponse, ClientError> {
        let answer = self
            .settings
            .retry
            .run(&self.base, self.settings.register_deadline, || {
                self.register_once(worker)
            })
            .await?;
        tracing::info!(lease_id = ?answer.lease_id, "worker registered");
        Ok(answer)
    }

    /// One attempt of `POST /register`.
    pub(crate) async fn register_once(
        &self,
        worker: &RegisterWorker,
    ) -> Result<RegisterResponse, ClientError> {
        self.call_ok(Method::POST, "/register", Some(worker)).await
    }

    /// Renews a lease (`POST /leases/{id}/keepalive`); one attempt. A lease that expired or was
    /// revoked answers [`ClientError::Rejected`] with status 404: register again.
    pub async fn keep_alive(&self, lease_id: LeaseId) -> Result<LeaseStatus, ClientError> {
        let path = format!("/leases/{lease_id}/keepalive");
        self.call_ok::<(), _>(Method::POST, &path, None).await
    }

    /// Ends a lease and removes the workers registered under it (`DELETE /leases/{id}`),
    /// retried until the call deadline. Returns whether the lease was live.
    #[tracing::instrument(skip(self), fields(url = %self.base))]
    pub async fn revoke_lease(&self, lease_id: LeaseId) -> Result<bool, ClientError> {
        let path = format!("/leases/{lease_id}");
        let answer: RevokeResponse = self
            .settings
            .retry
            .run(&self.base, self.settings.call_deadline, || {
                self.call_ok::<(), _>(Method::DELETE, &path, None)
            })
            .await?;
        Ok(answer.revoked)
    }

    /// Every registered worker and the revision to watch from (`GET /workers`); one attempt.
    pub async fn workers(&self) -> Result<WorkerList, ClientError> {
        self.call_ok::<(), _>(Method::GET, "/workers", None).await
    }

    /// One `GET /watch?since=REV` long poll, waiting up to the watch wait for a change (its HTTP
    /// timeout is the wait plus the request timeout). A `since` older than the server's history
    /// is [`ClientError::Rejected`] with status 410. See [`BootstrapClient::watch`] for a stream.
    pub(crate) async fn watch_once(&self, since: Revision) -> Result<WatchBatch, ClientError> {
        let wait = self.settings.watch_wait;
        let path = format!("/watch?since={since}&timeout_ms={}", wait.as_millis());
        let timeout = wait + self.settings.request_timeout;
        self.call_ok_within::<(), _>(Method::GET, &path, None, timeout)
            .await
    }

    /// Removes registrations (`DELETE /register`): a whole engine, or the ranks given. Returns
    /// how many worker slots went. Retried until the call deadline.
    #[tracing::instrument(skip_all, fields(url = %self.base, engine_id = %selection.engine_id))]
    pub async fn deregister(&self, selection: &Deregister) -> Result<usize, ClientError> {
        let answer: DeregisterResponse = self
            .settings
            .retry
            .run(&self.base, self.settings.call_deadline, || {
                self.call_ok(Method::DELETE, "/register", Some(selection))
            })
            .await?;
        Ok(answer.removed)
    }

    /// Marks an engine draining (`POST /engines/{id}/drain`: routers send it no new requests)
    /// or lifts the mark (`DELETE`); returns how many workers the engine has. Retried until
    /// the call deadline; an unknown engine is [`ClientError::Rejected`] with status 404.
    #[tracing::instrument(skip(self), fields(url = %self.base))]
    pub async fn drain(&self, engine_id: &str, draining: bool) -> Result<usize, ClientError> {
        let method = if draining {
            Method::POST
        } else {
            Method::DELETE
        };
        let path = format!("/engines/{}/drain", percent_encode(engine_id));
        let answer: DrainResponse = self
            .settings
            .retry
            .run(&self.base, self.settings.call_deadline, || {
                self.call_ok::<(), _>(method.clone(), &path, None)
            })
            .await?;
        Ok(answer.workers)
    }

    /// P side: maps a request id to the dp rank holding its KV (`POST /register_request`),
    /// retried until the call deadline.
    #[tracing::instrument(skip(self), fields(url = %self.base))]
    pub async fn register_request(&self, req_id: &str, dp_rank: Rank) -> Result<(), ClientError> {
        let body = RegisterRequest {
            req_id: req_id.to_owned(),
            dp_rank,
        };
        self.settings
            .retry
            .run(&self.base, self.settings.call_deadline, || {
                self.call_ok::<_, Status>(Method::POST, "/register_request", Some(&body))
            })
            .await?;
        Ok(())
    }

    /// P side: forgets a request id once its KV was pulled (`DELETE /requests/{id}`). Returns
    /// whether it was live. One attempt: a lost release only means the id expires by TTL.
    #[tracing::instrument(skip(self), fields(url = %self.base))]
    pub async fn release_request(&self, req_id: &str) -> Result<bool, ClientError> {
        let path = format!("/requests/{}", percent_encode(req_id));
        let answer: ReleaseResponse = self.call_ok::<(), _>(Method::DELETE, &path, None).await?;
        Ok(answer.released)
    }

    /// The registered topology (`GET /query`), optionally one engine's; one attempt. A 503
    /// (topology incomplete) is [`ClientError::Unavailable`].
    #[tracing::instrument(skip(self), fields(url = %self.base))]
    pub async fn topology(&self, engine_id: Option<&str>) -> Result<Topology, ClientError> {
        let path = match engine_id {
            Some(engine) => format!("/query?engine_id={}", percent_encode(engine)),
            None => "/query".to_owned(),
        };
        self.call_ok::<(), _>(Method::GET, &path, None).await
    }

    /// The topology, retried (connection failures, 503 "not ready") until the call deadline.
    pub async fn topology_with_retry(&self) -> Result<Topology, ClientError> {
        self.settings
            .retry
            .run(&self.base, self.settings.call_deadline, || {
                self.topology(None)
            })
            .await
    }

    /// One `POST /query_requests` round: the raw answer for every id.
    #[tracing::instrument(skip(self, req_ids), fields(url = %self.base, ids = req_ids.len()))]
    pub async fn query_requests_once(
        &self,
        req_ids: &[String],
        tp_rank: Rank,
        tp_size: Rank,
    ) -> Result<QueryRequestsResponse, ClientError> {
        let body = QueryRequests {
            req_ids: req_ids.to_vec(),
            tp_rank,
            tp_size,
        };
        self.call_ok(Method::POST, "/query_requests", Some(&body))
            .await
    }

    /// D side: resolves a batch of request ids, asking again (with backoff) for those P has not
    /// registered yet, until each is resolved or failed, or `deadline` has passed (those are
    /// [`RequestOutcome::TimedOut`]). Transport failures are retried within the same deadline; a
    /// 4xx (e.g. a tp size mismatch) ends the call with an error.
    #[tracing::instrument(skip(self, req_ids), fields(url = %self.base, ids = req_ids.len()))]
    pub async fn query_requests(
        &self,
        req_ids: &[String],
        tp_rank: Rank,
        tp_size: Rank,
        deadline: Duration,
    ) -> Result<BTreeMap<String, RequestOutcome>, ClientError> {
        let started = Instant::now();
        let mut outcomes = BTreeMap::new();
        let mut pending: Vec<String> = req_ids.to_vec();
        let mut pauses = self.settings.retry.schedule();
        let mut first_round = true;
        while !pending.is_empty() {
            let mut left = deadline.saturating_sub(started.elapsed());
            if first_round {
                // Always ask once, even with a zero deadline.
                left = left.max(self.settings.request_timeout);
                first_round = false;
            } else if left.is_zero() {
                break;
            }
            // The server answers at most MAX_QUERY_IDS ids per call.
            let mut results = BTreeMap::new();
            for chunk in pending.chunks(MAX_QUERY_IDS) {
                let round = self.settings.retry.run(&self.base, left, || {
                    self.query_requests_once(chunk, tp_rank, tp_size)
                });
                match round.await {
                    Ok(answer) => results.extend(answer.results),
                    Err(ClientError::DeadlineExceeded { .. }) => break,
                    Err(err) => return Err(err),
                }
            }
            let mut still_pending = Vec::new();
            for id in pending {
                match results.get(&id) {
                    Some(RequestLocation::Ok(addrs)) => {
                        outcomes.insert(id, RequestOutcome::Ready(addrs.clone()));
                    }
                    Some(RequestLocation::Error(text)) => {
                        outcomes.insert(id, RequestOutcome::Failed(text.clone()));
                    }
                    Some(RequestLocation::Retry) | None => still_pending.push(id),
                }
            }
            pending = still_pending;
            let left = deadline.saturating_sub(started.elapsed());
            if !pending.is_empty() && !left.is_zero() {
                let pause = pauses.next().unwrap_or(self.settings.retry.max_backoff);
                tokio::time::sleep(pause.min(left)).await;
            }
        }
        for id in pending {
            outcomes.insert(id, RequestOutcome::TimedOut);
        }
        Ok(outcomes)
    }

    /// Readiness of the configured topology (`GET /ready`; a 503 answer is a not-ready status,
    /// not an error); one attempt.
    pub async fn ready(&self) -> Result<ReadyStatus, ClientError> {
        self.call::<(), ReadyStatus>(Method::GET, "/ready", None, self.settings.request_timeout)
            .await
            .map(|(_, status)| status)
    }

    /// Waits until the topology is complete or `timeout` has passed; returns the last status
    /// seen (check its `status` field) or the error if the server was never reachable.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<ReadyStatus, ClientError> {
        let started = Instant::now();
        let mut pauses = self.settings.retry.schedule();
        let mut last = Err(ClientError::Timeout {
            url: format!("{}/ready", self.base),
            timeout,
        });
        loop {
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return last;
            }
            match tokio::time::timeout(left, self.ready()).await {
                Ok(Ok(status)) if status.status == "ready" => return Ok(status),
                Ok(Ok(status)) => last = Ok(status),
                // Keep the last status seen over a later transport error.
                Ok(Err(err)) if last.is_err() => last = Err(err),
                Ok(Err(_)) | Err(_) => {}
            }
            let left = timeout.saturating_sub(started.elapsed());
            let pause = pauses.next().unwrap_or(self.settings.retry.max_backoff);
            tokio::time::sleep(pause.min(left)).await;
        }
    }
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
    fn urls_are_checked_and_normalized() {
        assert_eq!(normalize_url("http://h:8998/").unwrap(), "http://h:8998");
        assert!(normalize_url("tcp://h:8998").is_err());
        assert!(normalize_url("h:8998").is_err());
        assert!(normalize_url("").is_err());
    }

    #[test]
    fn ids_are_encoded_for_paths() {
        assert_eq!(percent_encode("a b/c?d"), "a%20b%2Fc%3Fd");
        assert_eq!(percent_encode("xfer-1"), "xfer-1");
    }
}
