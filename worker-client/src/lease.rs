//! [`LeaseKeeper`]: a worker registration that lives only while this process keeps its lease
//! alive, so that a worker that dies without deregistering disappears from the registry by itself.

use std::fmt;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::Instrument;

use crate::client::BootstrapClient;
use crate::error::ClientError;
use pd_protocol::vllm::{RegisterResponse, RegisterWorker};
use pd_protocol::{LeaseId, MAX_LEASE_TTL};

/// Where a [`LeaseKeeper`]'s registration stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseState {
    /// Registered, and kept alive under this lease.
    Alive {
        /// The lease (a new one after each re-registration).
        lease_id: LeaseId,
        /// Its time to live in seconds, as the server granted it.
        ttl: u32,
    },
    /// The registration is gone (the lease expired or was revoked); the keeper is registering the
    /// worker again, with backoff, for as long as it lives.
    Lost {
        /// Why it was lost.
        reason: String,
    },
    /// The server refused to register the worker again (e.g. another engine took the slot): the
    /// keeper has stopped and the worker is not registered.
    Failed {
        /// The server's refusal.
        reason: String,
    },
}

/// A granted lease and when its last renewal was acknowledged.
#[derive(Debug, Clone, Copy)]
struct Lease {
    id: LeaseId,
    ttl: Duration,
    /// When the answer to the last successful registration or keepalive arrived: the server
    /// renewed the lease before this, so it has certainly expired one ttl after it.
    renewed: Instant,
}

impl Lease {
    /// The lease of a registration answer, or an error when the server granted none (a server
    /// that does not know leases, e.g. vLLM's own, ignores `lease_ttl`).
    fn granted(answer: &RegisterResponse, url: &str) -> Result<Self, ClientError> {
        match (answer.lease_id, answer.lease_ttl) {
            (Some(id), Some(ttl)) => Ok(Lease {
                id,
                ttl: Duration::from_secs(ttl.into()),
                renewed: Instant::now(),
            }),
            _ => Err(ClientError::InvalidResponse {
                url: format!("{url}/register"),
                reason: "the server registered the worker but granted no lease (it does not \
                         support leases?); the registration stays until it is deregistered"
                    .to_owned(),
            }),
        }
    }

    fn expires(&self) -> Instant {
        self.renewed + self.ttl
    }

    fn state(&self) -> LeaseState {
        LeaseState::Alive {
            lease_id: self.id,
            ttl: u32::try_from(self.ttl.as_secs()).unwrap_or(u32::MAX),
        }
    }
}

/// Names a worker in log lines: `engine E dp D/tp T/pp P`.
struct SlotName<'a>(&'a RegisterWorker);

impl fmt::Display for SlotName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = self.0;
        write!(
            f,
            "engine {} dp {}/tp {}/pp {}",
            w.engine_id, w.dp_rank, w.tp_rank, w.pp_rank
        )
    }
}

/// A worker registered under a lease, kept alive by a background task until
/// [`LeaseKeeper::release`] (which deregisters it) or until the keeper is dropped (then the
/// registration expires one ttl later). Made by [`BootstrapClient::register_leased`].
///
/// The task sends a keepalive every third of the ttl. A failed keepalive is retried sooner, with
/// backoff, while the lease may still be live (a `warn!` each time). Once the lease has certainly
/// expired (a ttl has passed since the last acknowledged renewal), or the server answers 404
/// (expired, revoked, or forgotten by a restarted server), the task says so with an `error!`,
/// turns [`LeaseState::Lost`], and registers the worker again under a new lease, without
/// `replace`, until that succeeds or the keeper goes away. If the server refuses (another engine
/// took the slot meanwhile), it logs an `error!` and stops: [`LeaseState::Failed`].
#[derive(Debug)]
pub struct LeaseKeeper {
    client: BootstrapClient,
    worker: RegisterWorker,
    state: watch::Receiver<LeaseState>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl BootstrapClient {
    /// Registers `worker` under a lease of `ttl_secs` seconds (1 to a day) and keeps the lease
    /// alive in the background; see [`LeaseKeeper`] for what happens when keepalives fail. The first registration is retried like
    /// [`BootstrapClient::register_worker`] (until the register deadline); the worker's
    /// `lease_ttl` is overridden, and `replace` applies to this first registration only.
    ///
    /// Fails with [`ClientError::InvalidInput`] for a ttl out of range and with
    /// [`ClientError::InvalidResponse`] when the server granted no lease. Must be called within a
    /// Tokio runtime.
    pub async fn register_leased(
        &self,
        worker: &RegisterWorker,
        ttl_secs: u32,
    ) -> Result<LeaseKeeper, ClientError> {
        if !(1..=MAX_LEASE_TTL).contains(&ttl_secs) {
            return Err(ClientError::InvalidInput {
                reason: format!(
                    "lease_ttl: {ttl_secs} is out of range (1 to {MAX_LEASE_TTL} seconds)"
                ),
            });
        }
        let mut worker = RegisterWorker {
            lease_ttl: Some(ttl_secs),
            ..worker.clone()
        };
        let answer = self.register_worker(&worker).await?;
        let lease = Lease::granted(&answer, self.url())?;
        tracing::info!(lease_id = lease.id, ttl = ?lease.ttl, "{} registered under a lease", SlotName(&worker));
        // Registering again must never take the slot from an engine that owns it by then.
        worker.replace = Some(false);
        let (state_tx, state) = watch::channel(lease.state());
        let (stop, stopped) = watch::channel(false);
        let span = tracing::info_span!("lease_keeper", url = %self.url(), engine_id = %worker.engine_id,
            dp = worker.dp_rank, tp = worker.tp_rank, pp = worker.pp_rank);
        let task = tokio::spawn(
            Keeper {
                client: self.clone(),
                worker: worker.clone(),
                state: state_tx,
                stopped,
            }
            .run(lease)
            .instrument(span),
        );
        Ok(LeaseKeeper {
            client: self.clone(),
            worker,
            state,
            stop,
            task,
        })
    }
}

impl LeaseKeeper {
    /// The current state.
    pub fn state(&self) -> LeaseState {
        self.state.borrow().clone()
    }

    /// True while the worker is registered under a live lease.
    pub fn is_alive(&self) -> bool {
        matches!(*self.state.borrow(), LeaseState::Alive { .. })
    }

    /// The current lease, while the worker is registered.
    pub fn lease_id(&self) -> Option<LeaseId> {
        match *self.state.borrow() {
            LeaseState::Alive { lease_id, .. } => Some(lease_id),
            _ => None,
        }
    }

    /// A receiver of every state change (e.g. to report health, or to await
    /// [`LeaseState::Failed`]).
    pub fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.state.clone()
    }

    /// The registration being kept alive.
    pub fn worker(&self) -> &RegisterWorker {
        &self.worker
    }

    /// Stops keeping the lease alive and revokes it, which removes the registration at once.
    /// Returns whether the lease was live (false when it had been lost). Waits for a keepalive
    /// or registration in flight (at most one request timeout), then retries the revocation
    /// until the call deadline.
    pub async fn release(mut self) -> Result<bool, ClientError> {
        let _ = self.stop.send(true);
        let bound = self.client.request_timeout() + Duration::from_secs(1);
        if tokio::time::timeout(bound, &mut self.task).await.is_err() {
            self.task.abort();
        }
        match self.lease_id() {
            Some(lease_id) => {
                let revoked = self.client.revoke_lease(lease_id).await?;
                tracing::info!(lease_id, "{}: lease revoked", SlotName(&self.worker));
                Ok(revoked)
            }
            None => Ok(false),
        }
    }
}

impl Drop for LeaseKeeper {
    /// Stops the background task (the registration then expires one ttl after its last renewal).
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The background task of one [`LeaseKeeper`]; it ends when stopped or when it gives up.
struct Keeper {
    client: BootstrapClient,
    worker: RegisterWorker,
    state: watch::Sender<LeaseState>,
    stopped: watch::Receiver<bool>,
}

/// How keeping one lease alive ended.
enum Kept {
    /// The keeper was asked to stop.
    Stopped,
    /// The lease is gone; the worker must register again.
    Lost(String),
}

impl Keeper {
    /// Keeps leases alive, registering again after each loss, until stopped or refused.
    async fn run(mut self, mut lease: Lease) {
        loop {
            match self.keep(&mut lease).await {
                Kept::Stopped => return,
                Kept::Lost(reason) => {
                    self.state.send_replace(LeaseState::Lost { reason });
                }
            }
            match self.register_again().await {
                Some(new) => lease = new,
                None => return,
            }
        }
    }

    /// Waits `pause`; false when the keeper was stopped (or dropped) meanwhile.
    async fn pause(&mut self, pause: Duration) -> bool {
        if *self.stopped.borrow() {
            return false;
        }
        tokio::select! {
            _ = self.stopped.changed() => false,
            () = tokio::time::sleep(pause) => true,
        }
    }

    /// Renews `lease` every third of its ttl, sooner after a failure, until it is lost.
    async fn keep(&mut self, lease: &mut Lease) -> Kept {
        let slot = SlotName(&self.worker).to_string();
        let mut pauses = self.client.retry_policy().schedule();
        let mut failing = false;
        let mut next = lease.renewed + lease.ttl / 3;
        loop {
            if !self
                .pause(next.saturating_duration_since(Instant::now()))
                .await
            {
                return Kept::Stopped;
            }
            let left = lease.expires().saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Self::expired(lease, &slot);
            }
            let budget = self.client.request_timeout().min(left);
            let attempt = tokio::time::timeout(budget, self.client.keep_alive(lease.id)).await;
            let err = match attempt {
                Ok(Ok(status)) => {
                    lease.renewed = Instant::now();
                    lease.ttl = Duration::from_secs(status.lease_ttl.into());
                    if failing {
                        tracing::info!(lease_id = lease.id, "lease renewed again");
                        failing = false;
                        pauses = self.client.retry_policy().schedule();
                    }
                    next = lease.renewed + lease.ttl / 3;
                    continue;
                }
                Ok(Err(err)) if err.status() == Some(404) => {
                    let reason = format!(
                        "lease {} is gone from the server (expired, revoked, or the server lost \
                         it): the registration of {slot} is gone from the registry",
                        lease.id
                    );
                    tracing::error!(lease_id = lease.id, error = %err, "{reason}; registering again");
                    return Kept::Lost(reason);
                }
                Ok(Err(err)) => err,
                Err(_elapsed) => ClientError::Timeout {
                    url: format!("{}/leases/{}/keepalive", self.client.url(), lease.id),
                    timeout: budget,
                },
            };
            let left = lease.expires().saturating_duration_since(Instant::now());
            if left.is_zero() {
                tracing::warn!(lease_id = lease.id, error = %err, "lease keepalive failed");
                return Self::expired(lease, &slot);
            }
            failing = true;
            let pause = pauses
                .next()
                .unwrap_or(self.client.retry_policy().max_backoff)
                .min(left);
            tracing::warn!(lease_id = lease.id, error = %err, retry_in = ?pause, expires_in = ?left,
                "lease keepalive failed; retrying before the lease expires");
            next = Instant::now() + pause;
        }
    }

    /// Says loudly that `lease` expired without a successful keepalive.
    fn expired(lease: &Lease, slot: &str) -> Kept {
        let reason = format!(
            "lease {} expired: the registration of {slot} is gone from the registry",
            lease.id
        );
        tracing::error!(lease_id = lease.id, ttl = ?lease.ttl, "{reason} (no keepalive succeeded within its ttl); registering again");
        Kept::Lost(reason)
    }

    /// Registers the worker again under a new lease, retrying transient failures with backoff
    /// until it succeeds or the keeper is stopped. `None` when stopped or refused (then the state
    /// is [`LeaseState::Failed`]).
    async fn register_again(&mut self) -> Option<Lease> {
        let mut pauses = self.client.retry_policy().schedule();
        loop {
            if *self.stopped.borrow() {
                return None;
            }
            let refused = match self.client.register_once(&self.worker).await {
                Ok(answer) => match Lease::granted(&answer, self.client.url()) {
                    Ok(lease) => {
                        tracing::warn!(
                            lease_id = lease.id,
                            "{} registered again under a new lease",
                            SlotName(&self.worker)
                        );
                        self.state.send_replace(lease.state());
                        return Some(lease);
                    }
                    Err(err) => err,
                },
                Err(err) if err.is_retryable() => {
                    let pause = pauses
                        .next()
                        .unwrap_or(self.client.retry_policy().max_backoff);
                    tracing::warn!(error = %err, retry_in = ?pause, "{} cannot register again yet", SlotName(&self.worker));
                    if !self.pause(pause).await {
                        return None;
                    }
                    continue;
                }
                Err(err) => err,
            };
            tracing::error!(error = %refused, "{} cannot be registered again (another engine may own the slot now); the lease keeper stops", SlotName(&self.worker));
            self.state.send_replace(LeaseState::Failed {
                reason: refused.to_string(),
            });
            return None;
        }
    }
}
