//! The registry: one type that owns the worker table and the request-id table, validates every
//! change, makes it durable through a [`Store`], and serves the HTTP routes.

mod follow;
mod history;
mod leases;
mod requests;
pub mod validate;
mod watch;
mod workers;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::registry::validate::{
    validate_addr, validate_id, validate_lease_ttl, validate_rank, FieldError,
};
use bytes::Bytes;
use pd_protocol::native::Deregister;
use pd_protocol::vllm::{
    QueryRequests, QueryRequestsResponse, RegisterLegacyWorker, RegisterRequest, RegisterResponse,
    RegisterWorker, RequestLocation, MAX_QUERY_IDS,
};
use pd_protocol::{LeaseId, Rank, Revision};

pub use history::{Compacted, History, HISTORY_CAPACITY};
pub use requests::{Inserted, RequestConflict, RequestTable};
pub use workers::{EngineConflictPolicy, RegisterOutcome, WorkerConflict, WorkerTable};

use crate::store::{RequestRecord, Slot, Store, StoreError, WorkerChange, WorkerRecord};
use crate::sync::{lock, now_ms};

/// How many expired ids one pruning step removes before it lets others take the lock.
const PRUNE_BATCH: usize = 4096;

/// How often a worker change is planned again after another replica changed the table first.
const WRITE_ATTEMPTS: usize = 8;

/// How long a committed change may take to come back from the store before the write is
/// reported as failed (it is durable; a retry of the same registration is a no-op).
const APPLY_WAIT: Duration = Duration::from_secs(10);

/// How long a write that lost a race waits for the winner's change to arrive.
const CONFLICT_WAIT: Duration = Duration::from_secs(2);

/// The P deployment's expected shape; `GET /query` answers 503 until every rank has registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpectedTopology {
    /// Number of dp ranks.
    pub dp_size: Rank,
    /// Number of tp ranks per dp rank.
    pub tp_size: Rank,
    /// Number of pp ranks per tp rank.
    pub pp_size: Rank,
}

impl ExpectedTopology {
    /// How many workers make the topology complete.
    pub fn worker_count(&self) -> usize {
        self.dp_size as usize * self.tp_size as usize * self.pp_size as usize
    }
}

/// Registry settings.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// The expected topology, if the operator configured one.
    pub expected: Option<ExpectedTopology>,
    /// How long a request id lives after registration.
    pub request_ttl: Duration,
    /// The most live request ids held at once.
    pub max_requests: usize,
    /// What a new engine id for an owned dp rank does.
    pub engine_conflict: EngineConflictPolicy,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        RegistryConfig {
            expected: None,
            request_ttl: Duration::from_secs(960),
            max_requests: 2_000_000,
            engine_conflict: EngineConflictPolicy::Reject,
        }
    }
}

/// Why the registry refused a call. The HTTP layer maps each kind to a status code.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A field is malformed (422).
    #[error(transparent)]
    Invalid(#[from] FieldError),
    /// A rank is not below the configured size (400, vLLM's wording).
    #[error("{0}")]
    OutOfRange(String),
    /// A registration conflicts with what is on record (400, vLLM's wording).
    #[error(transparent)]
    Worker(#[from] WorkerConflict),
    /// A request id conflicts, or the table is full.
    #[error(transparent)]
    Request(#[from] RequestConflict),
    /// D's tp size differs from P's (400, vLLM's wording).
    #[error(
        "heterogeneous TP is not supported yet. TP size mismatch: expected {expected}, got {got}"
    )]
    TpSizeMismatch {
        /// P's tp size.
        expected: Rank,
        /// The tp size D sent.
        got: Rank,
    },
    /// The expected topology is incomplete (503).
    #[error("Mooncake prefiller worker topology is not ready: {missing} of {expected} workers have not registered.")]
    NotReady {
        /// Workers still missing.
        missing: usize,
        /// Workers expected in all.
        expected: usize,
    },
    /// No dp rank belongs to this engine (404).
    #[error("engine_id {0:?} is not registered")]
    UnknownEngine(String),
    /// The lease has expired, was revoked or never existed (404).
    #[error("lease {0} is not live (expired or revoked): register again")]
    UnknownLease(LeaseId),
    /// A watcher asked for changes older than the history kept (410).
    #[error("revision {since} is older than the history kept (from {floor}): re-list with GET /workers and watch from its revision")]
    Compacted {
        /// What the watcher asked for.
        since: Revision,
        /// The oldest revision it can resume from.
        floor: Revision,
        /// The current revision.
        revision: Revision,
    },
    /// A watcher asked for changes after a revision this registry has not reached, even after
    /// waiting: it was restored from an older state, or the watcher knows another registry (410).
    #[error("revision {since} is newer than this registry's {revision} (restored, or another registry): re-list with GET /workers and watch from its revision")]
    AheadOfRegistry {
        /// What the watcher asked for.
        since: Revision,
        /// The current revision.
        revision: Revision,
    },
    /// The store failed (503: retrying may help).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How complete the registered topology is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Readiness {
    /// Registered workers.
    pub registered: usize,
    /// Expected workers, when a topology is configured.
    pub expected: Option<usize>,
    /// Expected workers not yet registered (0 without a configured topology).
    pub missing: usize,
}

/// Counts for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    /// Registered workers.
    pub workers: usize,
    /// Engines owning at least one dp rank.
    pub engines: usize,
    /// Live request ids.
    pub live_requests: usize,
    /// The revision of the registry's worker table.
    pub revision: Revision,
    /// Whether the store currently follows every change (an etcd watch can be down).
    pub store_connected: bool,
}

/// The pre-rendered answers of `GET /query`, rebuilt lazily after a change.
struct TopologyView {
    all: Bytes,
    by_engine: HashMap<String, Bytes>,
    readiness: Readiness,
    engines: usize,
}

struct WorkerState {
    table: WorkerTable,
    /// The revision of the last committed worker change (what the next commit is guarded by).
    guard: Revision,
    /// P's tp size as the table shows it, kept current on every change (lookups read it).
    observed_tp_size: Option<Rank>,
    view: Option<Arc<TopologyView>>,
    history: History,
}

impl WorkerState {
    fn new(snapshot_workers: Vec<WorkerRecord>, revision: Revision, guard: Revision) -> Self {
        let table = WorkerTable::from_records(snapshot_workers);
        WorkerState {
            observed_tp_size: table.observed_tp_size(),
            table,
            guard,
            view: None,
            history: History::new(revision, HISTORY_CAPACITY),
        }
    }
}

/// The P/D registry shared by the HTTP routes and the storage backend.
///
/// Its tables are a cache of the store: they change only through [`StoreEvent`](crate::store::StoreEvent)s, in revision
/// order, so that this replica's writes, other replicas' writes and expired leases all land the
/// same way.
pub struct Registry {
    config: RegistryConfig,
    store: Arc<dyn Store>,
    /// Serializes this replica's worker changes so that plan and commit happen as one step.
    write_gate: tokio::sync::Mutex<()>,
    workers: RwLock<WorkerState>,
    requests: Mutex<RequestTable>,
    /// The revision of the last worker change applied; writers and watchers wait on it.
    applied: tokio::sync::watch::Sender<Revision>,
    /// The store revision the tables are current at: worker changes, and with etcd also request
    /// ids and progress reports, so that every replica in sync reports the same revision. It
    /// only moves past a worker change while the workers lock is held for writing.
    revision: AtomicU64,
}

fn to_bytes<T: serde::Serialize>(value: &T) -> Bytes {
    // Maps with integer or string keys and string values always serialize.
    Bytes::from(serde_json::to_vec(value).expect("topology serializes"))
}

impl Registry {
    /// Loads the registry from `store` (dropping request ids that expired while it was down) and
    /// starts following the store's changes.
    pub async fn open(
        store: Arc<dyn Store>,
        config: RegistryConfig,
    ) -> Result<Arc<Self>, StoreError> {
        let snapshot = store.load().await?;
        let events = store.subscribe(snapshot.revision);
        let revision = snapshot.revision;
        let (workers, requests, expired) = Self::tables(snapshot, &config);
        if !expired.is_empty() {
            store.forget_expired(&expired).await?;
        }
        tracing::info!(
            workers = workers.table.worker_count(),
            engines = workers.table.engine_count(),
            live_requests = requests.len(),
            expired_on_load = expired.len(),
            revision,
            "registry loaded"
        );
        let registry = Arc::new(Registry {
            config,
            store,
            write_gate: tokio::sync::Mutex::new(()),
            workers: RwLock::new(workers),
            requests: Mutex::new(requests),
            applied: tokio::sync::watch::Sender::new(revision),
            revision: AtomicU64::new(revision),
        });
        tokio::spawn(Self::follow(Arc::downgrade(&registry), events));
        Ok(registry)
    }

    /// The settings the registry runs with.
    pub fn config(&self) -> &RegistryConfig {
        &self.config
    }

    fn check_rank(
        &self,
        kind: &str,
        rank: Rank,
        size: impl Fn(&ExpectedTopology) -> Rank,
    ) -> Result<(), RegistryError> {
        match &self.config.expected {
            Some(expected) if rank >= size(expected) => Err(RegistryError::OutOfRange(format!(
                "{kind} rank {rank} must be less than {kind} size {}.",
                size(expected)
            ))),
            _ => Ok(()),
        }
    }

    fn check_slot(&self, slot: Slot) -> Result<(), RegistryError> {
        validate_rank("dp_rank", slot.dp)?;
        validate_rank("tp_rank", slot.tp)?;
        validate_rank("pp_rank", slot.pp)?;
        self.check_rank("DP", slot.dp, |e| e.dp_size)?;
        self.check_rank("TP", slot.tp, |e| e.tp_size)?;
        self.check_rank("PP", slot.pp, |e| e.pp_size)
    }

    /// `POST /register`: records one worker of an engine, under a new lease when it asks for one.
    pub async fn register(
        self: &Arc<Self>,
        reg: &RegisterWorker,
    ) -> Result<RegisterResponse, RegistryError> {
        validate_id("engine_id", &reg.engine_id)?;
        validate_addr("addr", &reg.addr)?;
        if let Some(ttl) = reg.lease_ttl {
            validate_lease_ttl("lease_ttl", ttl)?;
        }
        let slot = Slot {
            dp: reg.dp_rank,
            tp: reg.tp_rank,
            pp: reg.pp_rank,
        };
        self.check_slot(slot)?;
        let lease = match reg.lease_ttl {
            Some(ttl) => Some(self.store.grant_lease(ttl).await?),
            None => None,
        };
        let (engine_id, addr, replace) = (reg.engine_id.clone(), reg.addr.clone(), reg.replace);
        let policy = self.config.engine_conflict;
        let superseded = self.read_workers().table.get(slot).and_then(|w| w.lease);
        let written = self
            .write(move |table| {
                let plan = table.plan_register(&engine_id, slot, &addr, replace, policy, lease)?;
                Ok((plan.change, plan.outcome))
            })
            .await;
        let outcome = match written {
            Ok(outcome) => outcome,
            Err(err) => {
                let not_written = !matches!(
                    err,
                    RegistryError::Store(StoreError::Backend(_) | StoreError::Corrupt { .. })
                );
                if let (Some(lease), true) = (lease, not_written) {
                    // Certainly nothing was written under it (a refusal, or a lost race): revoking
                    // only saves it waiting out its ttl. After a store failure the commit may
                    // have landed, and the lease must keep what it holds.
                    let _ = self.store.revoke_lease(lease.id).await;
                }
                return Err(err);
            }
        };
        self.revoke_if_unused(superseded.filter(|old| Some(*old) != lease));
        let lease_id = lease.map(|l| l.id);
        match &outcome {
            RegisterOutcome::Created => {
                tracing::info!(engine_id = %reg.engine_id, %slot, addr = %reg.addr, ?lease_id, "worker registered")
            }
            RegisterOutcome::Replaced { previous_engine } => tracing::warn!(
                engine_id = %reg.engine_id, %slot, addr = %reg.addr, ?lease_id,
                previous_engine = previous_engine.as_deref().unwrap_or("-"),
                "worker registration replaced an earlier one"
            ),
            RegisterOutcome::Replayed => {}
        }
        Ok(RegisterResponse {
            status: "ok".to_owned(),
            lease_id,
            lease_ttl: lease.map(|l| l.ttl),
        })
    }

    /// `POST /register_worker`: records a worker of vLLM's request-keyed API (pp rank 0).
    pub async fn register_legacy(
        self: &Arc<Self>,
        reg: &RegisterLegacyWorker,
    ) -> Result<(), RegistryError> {
        validate_addr("worker_addr", &reg.worker_addr)?;
        self.check_slot(Slot {
            dp: reg.dp_rank,
            tp: reg.tp_rank,
            pp: 0,
        })?;
        let (dp, tp, addr) = (reg.dp_rank, reg.tp_rank, reg.worker_addr.clone());
        self.write(move |table| Ok((table.plan_register_legacy(dp, tp, &addr), ())))
            .await
    }

    /// `DELETE /register`: removes matching workers; returns how many.
    pub async fn deregister(self: &Arc<Self>, req: &Deregister) -> Result<usize, RegistryError> {
        validate_id("engine_id", &req.engine_id)?;
        let selection = req.clone();
        let removed = self
            .write(move |table| {
                let change = table.plan_deregister(
                    &selection.engine_id,
                    selection.dp_rank,
                    selection.tp_rank,
                    selection.pp_rank,
                );
                let removed = change.remove.len();
                Ok((change, removed))
            })
            .await?;
        if removed > 0 {
            tracing::info!(engine_id = %req.engine_id, removed, "workers deregistered");
        }
        Ok(removed)
    }

    /// Plans a worker change against the current table and commits it, guarded by the revision
    /// of the table it was planned on; returns once the change is in this replica's tables.
    ///
    /// The whole step runs on its own task, serialized by the write gate: a caller that goes away
    /// (client disconnect, request timeout) cannot cut it in half. When another replica changed
    /// the table first, the plan is made again on the fresher table (a bounded number of times).
    async fn write<T, P>(self: &Arc<Self>, plan: P) -> Result<T, RegistryError>
    where
        T: Send + 'static,
        P: Fn(&WorkerTable) -> Result<(WorkerChange, T), RegistryError> + Send + 'static,
    {
        let registry = self.clone();
        let task = tokio::spawn(async move {
            let _gate = registry.write_gate.lock().await;
            for _ in 0..WRITE_ATTEMPTS {
                let (guard, (change, outcome)) = {
                    let state = registry.read_workers();
                    (state.guard, plan(&state.table)?)
                };
                if change.is_empty() {
                    return Ok(outcome);
                }
                match registry.store.commit_workers(&change, guard).await {
                    Ok(revision) => {
                        registry.wait_applied(revision).await?;
                        return Ok(outcome);
                    }
                    Err(StoreError::Conflict) => registry.wait_guard_moved(guard).await,
                    Err(err) => return Err(err.into()),
                }
            }
            Err(RegistryError::Store(StoreError::Conflict))
        });
        task.await.map_err(|err| {
            RegistryError::Store(StoreError::Backend(format!(
                "registry write task failed: {err}"
            )))
        })?
    }

    /// Waits until this replica has applied `revision`.
    async fn wait_applied(&self, revision: Revision) -> Result<(), RegistryError> {
        let mut applied = self.applied.subscribe();
        let reached = applied.wait_for(|r| *r >= revision);
        let in_time = matches!(tokio::time::timeout(APPLY_WAIT, reached).await, Ok(Ok(_)));
        if in_time {
            return Ok(());
        }
        Err(RegistryError::Store(StoreError::Backend(format!(
            "the change was stored at revision {revision} but has not reached this replica yet"
        ))))
    }

    /// Waits (briefly) until a worker change newer than `guard` has been applied.
    async fn wait_guard_moved(&self, guard: Revision) {
        let mut applied = self.applied.subscribe();
        let moved = applied.wait_for(|_| self.read_workers().guard != guard);
        let _ = tokio::time::timeout(CONFLICT_WAIT, moved).await;
    }

    fn write_workers(&self) -> std::sync::RwLockWriteGuard<'_, WorkerState> {
        self.workers.write().unwrap_or_else(|e| e.into_inner())
    }

    fn read_workers(&self) -> std::sync::RwLockReadGuard<'_, WorkerState> {
        self.workers.read().unwrap_or_else(|e| e.into_inner())
    }

    fn view(&self) -> Arc<TopologyView> {
        if let Some(view) = &self.read_workers().view {
            return view.clone();
        }
        let mut state = self.write_workers();
        if state.view.is_none() {
            state.view = Some(Arc::new(self.render(&state.table)));
        }
        state.view.clone().expect("view was just rendered")
    }

    fn render(&self, table: &WorkerTable) -> TopologyView {
        let topology = table.topology(None);
        let mut engines: BTreeMap<&str, BTreeMap<Rank, &pd_protocol::vllm::DpGroup>> =
            BTreeMap::new();
        for (dp, group) in &topology {
            if let Some(engine) = group.engine_id.as_deref() {
                engines.entry(engine).or_default().insert(*dp, group);
            }
        }
        let by_engine = engines
            .iter()
            .map(|(engine, groups)| ((*engine).to_owned(), to_bytes(groups)))
            .collect();
        let registered = table.worker_count();
        let readiness = match &self.config.expected {
            Some(expected) => Readiness {
                registered,
                expected: Some(expected.worker_count()),
                missing: expected.worker_count().saturating_sub(table.count_within(
                    expected.dp_size,
                    expected.tp_size,
                    expected.pp_size,
                )),
            },
            None => Readiness {
                registered,
                expected: None,
                missing: 0,
            },
        };
        TopologyView {
            all: to_bytes(&topology),
            by_engine,
            readiness,
            engines: engines.len(),
        }
    }

    /// How complete the topology is.
    pub fn readiness(&self) -> Readiness {
        self.view().readiness
    }

    /// `GET /query`: the JSON of every dp group, or of one engine's.
    pub fn query(&self, engine_id: Option<&str>) -> Result<Bytes, RegistryError> {
        if let Some(engine) = engine_id {
            validate_id("engine_id", engine)?;
        }
        let view = self.view();
        if let Some(expected) = view.readiness.expected {
            if view.readiness.missing > 0 {
                return Err(RegistryError::NotReady {
                    missing: view.readiness.missing,
                    expected,
                });
            }
        }
        match engine_id {
            None => Ok(view.all.clone()),
            Some(engine) => view
                .by_engine
                .get(engine)
                .cloned()
                .ok_or_else(|| RegistryError::UnknownEngine(engine.to_owned())),
        }
    }

    /// `POST /register_request`: maps a request id to the dp rank that holds its KV.
    pub async fn register_request(&self, req: &RegisterRequest) -> Result<Inserted, RegistryError> {
        validate_id("req_id", &req.req_id)?;
        validate_rank("dp_rank", req.dp_rank)?;
        self.check_rank("DP", req.dp_rank, |e| e.dp_size)?;
        let now = now_ms();
        let record = RequestRecord {
            dp_rank: req.dp_rank,
            expires_at_ms: now + self.config.request_ttl.as_millis() as u64,
        };
        let inserted =
            lock(&self.requests).insert(&req.req_id, req.dp_rank, now, record.expires_at_ms)?;
        if inserted == Inserted::New {
            if let Err(err) = self.store.put_request(&req.req_id, record).await {
                lock(&self.requests).remove_if(&req.req_id, record);
                return Err(err.into());
            }
        }
        Ok(inserted)
    }

    /// `POST /query_requests`: where the KV of each id lives, for D's tp rank.
    pub fn query_requests(
        &self,
        query: &QueryRequests,
    ) -> Result<QueryRequestsResponse, RegistryError> {
        validate_rank("tp_rank", query.tp_rank)?;
        validate_rank("tp_size", query.tp_size)?;
        if query.req_ids.len() > MAX_QUERY_IDS {
            return Err(FieldError {
                field: "req_ids",
                problem: format!("{} ids asked, at most {MAX_QUERY_IDS}", query.req_ids.len()),
            }
            .into());
        }
        for id in &query.req_ids {
            validate_id("req_ids", id)?;
        }
        let workers = self.read_workers();
        // With a configured tp size, D's must equal it. Without one, P's is inferred from what
        // has registered so far, which may still be incomplete: only a D tp size below it is
        // certainly a mismatch (missing tp ranks answer per id).
        let mismatch = match (&self.config.expected, workers.observed_tp_size) {
            (Some(expected), _) => (expected.tp_size != query.tp_size).then_some(expected.tp_size),
            (None, Some(observed)) => (query.tp_size < observed).then_some(observed),
            (None, None) => None,
        };
        if let Some(expected) = mismatch {
            return Err(RegistryError::TpSizeMismatch {
                expected,
                got: query.tp_size,
            });
        }
        let now = now_ms();
        let ranks: Vec<Option<Rank>> = {
            let requests = lock(&self.requests);
            query
                .req_ids
                .iter()
                .map(|id| requests.get(id, now))
                .collect()
        };
        let results = query
            .req_ids
            .iter()
            .zip(ranks)
            .map(|(id, rank)| {
                let location = match rank {
                    None => RequestLocation::Retry,
                    Some(dp) if !workers.table.has_dp_group(dp) => {
                        RequestLocation::Error(format!("Prefiller DP group {dp} not found"))
                    }
                    Some(dp) => match workers.table.addresses(dp, query.tp_rank) {
                        addrs if addrs.is_empty() => RequestLocation::Error(format!(
                            "Prefiller TP rank {} not matched in DP group {dp}",
                            query.tp_rank
                        )),
                        addrs => RequestLocation::Ok(addrs),
                    },
                };
                (id.clone(), location)
            })
            .collect();
        Ok(QueryRequestsResponse { results })
    }

    /// `DELETE /requests/{req_id}`: forgets an id after its transfer; true when it was live.
    pub async fn release_request(&self, req_id: &str) -> Result<bool, RegistryError> {
        validate_id("req_id", req_id)?;
        let live = lock(&self.requests).get(req_id, now_ms()).is_some();
        // The store first, also for an id this replica does not hold: a retry after a failed
        // delete (or a release sent to another replica than the registration) still reaches it.
        self.store.remove_requests(&[Arc::from(req_id)]).await?;
        lock(&self.requests).remove(req_id);
        Ok(live)
    }

    /// Removes every expired request id; returns how many.
    pub async fn prune_expired(&self) -> usize {
        let mut total = 0;
        loop {
            let batch = lock(&self.requests).pop_expired(now_ms(), PRUNE_BATCH);
            if batch.is_empty() {
                break;
            }
            total += batch.len();
            if let Err(err) = self.store.forget_expired(&batch).await {
                // The ids are gone from memory; in the store they are dropped as expired at the
                // next load.
                tracing::warn!(error = %err, "could not delete pruned request ids from the store");
            }
        }
        if total > 0 {
            tracing::debug!(pruned = total, "expired request ids pruned");
        }
        total
    }

    /// Counts for `/metrics`.
    pub fn stats(&self) -> Stats {
        // Lock order everywhere: workers before requests (and never both through temporaries).
        let view = self.view();
        let revision = self.revision();
        let live_requests = lock(&self.requests).len();
        Stats {
            workers: view.readiness.registered,
            engines: view.engines,
            live_requests,
            revision,
            store_connected: self.store.connected(),
        }
    }

    /// Makes every buffered write durable and stops the store's background work (graceful
    /// shutdown). A worker change still running on its own task (its caller went away) is
    /// waited for first, for as long as a write may take, so none lands after the store closed.
    pub async fn close(&self) -> Result<(), StoreError> {
        let gate = tokio::time::timeout(APPLY_WAIT + CONFLICT_WAIT, self.write_gate.lock()).await;
        if gate.is_err() {
            tracing::warn!("a worker change was still running at shutdown");
        }
        // Held while the store closes: a change queued behind the gate would find it closed.
        let _gate = gate.ok();
        self.store.close().await
    }
}
