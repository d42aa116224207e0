//! The calls about workers: registration, leases, the watch's long poll, deregistration,
//! drain, the topology and readiness.

use std::time::{Duration, Instant};

use reqwest::Method;

use super::{percent_encode, BootstrapClient};
use crate::error::ClientError;
use pd_protocol::native::{
    Deregister, DeregisterResponse, DrainResponse, LeaseStatus, ReadyStatus, RevokeResponse,
    WatchBatch, WorkerList,
};
use pd_protocol::vllm::{RegisterResponse, RegisterWorker, Topology};
use pd_protocol::{LeaseId, Revision};

impl BootstrapClient {
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

    /// The topology as a decode sees it (`GET /query`), and how long until the server may show
    /// engines it holds back while their ranks are still registering (its `Retry-After`:
    /// pd-bootstrap's registry; none from a server that shows everything at once); one attempt.
    /// A 503 with a `Retry-After` (no engine shown yet) is an empty topology and that wait;
    /// another 503 is [`ClientError::Unavailable`].
    pub async fn topology_pending(&self) -> Result<(Topology, Option<Duration>), ClientError> {
        let path = "/query";
        let reply =
            (self.send_reply::<()>(Method::GET, path, None, self.request_timeout())).await?;
        let registering = reply.status == reqwest::StatusCode::SERVICE_UNAVAILABLE;
        match serde_json::from_slice::<Topology>(&reply.body) {
            Ok(topology) if reply.status.is_success() => Ok((topology, reply.retry_after)),
            _ if registering && reply.retry_after.is_some() => {
                Ok((Topology::new(), reply.retry_after))
            }
            _ => Err(self.answer_error(path, reply.status, &reply.body)),
        }
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
