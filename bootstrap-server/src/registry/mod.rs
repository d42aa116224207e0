//! The registry: one type that owns the worker table and the request-id table, validates every
//! change, makes it durable through a [`Store`], and answers in its own domain types
//! ([`model`]). It knows no HTTP and no dialect: the wire modules under [`crate::http`] map
//! vLLM's (or another) JSON to these calls and render the answers and errors their clients
//! expect.

mod config;
mod drain;
mod error;
mod follow;
mod history;
mod leases;
pub mod model;
mod plan;
pub mod publication;
mod request_table;
mod requests;
mod stats;
pub mod validate;
mod view;
mod watch;
mod workers;
mod write_stats;
mod writer;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock};

use pd_protocol::{Rank, Revision};

pub use config::{ExpectedTopology, RegistryConfig};
pub use error::RegistryError;
pub use history::{Compacted, History, HISTORY_CAPACITY};
pub use plan::{EngineConflictPolicy, Plan, RegisterOutcome, WorkerConflict};
pub use request_table::{IdTables, Inserted, RequestConflict, RequestTable};
pub use stats::Stats;
pub use view::View;
pub use watch::Changes;
pub use workers::{Group, WorkerTable};
pub use write_stats::WriteStats;

use self::model::{Deregistration, Lease, Readiness, Registration, Slot, WorkerRecord};
use self::validate::{validate_addr, validate_id, validate_lease_ttl, validate_rank};
use crate::store::{Store, StoreError, StoreEvents};

/// What a registration did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    /// The lease it lives by, if it asked for one.
    pub lease: Option<Lease>,
    /// Its engine's incarnation.
    pub incarnation: u64,
    /// How it was applied.
    pub outcome: RegisterOutcome,
}

/// The worker table as the writer plans on it, and as readers see it.
///
/// A change lands in `table` as soon as the store reports it (the next change is planned on
/// it), but readers (views, `GET /workers`, watchers) see `published`: while the writer holds
/// its batch, the changes applied meanwhile wait until its flush, so nothing is seen that a
/// crash could still take back. Publishing is a copy of `table`, which costs the same at any
/// size ([`WorkerTable`] is a persistent map).
struct WorkerState {
    table: WorkerTable,
    /// The revision of the last committed worker change (what the next commit is guarded by).
    guard: Revision,
    /// What readers see.
    published: WorkerTable,
    /// Set while the writer's batch is not durable yet: changes are then held back.
    holding: bool,
    /// Whether `table` has changes `published` does not.
    unpublished: bool,
    /// The revision readers are current at while changes are held back.
    published_at: Revision,
    view: Option<Arc<View>>,
    history: History,
}

impl WorkerState {
    fn new(snapshot_workers: Vec<WorkerRecord>, revision: Revision, guard: Revision) -> Self {
        let table = WorkerTable::from_records(snapshot_workers);
        WorkerState {
            published: table.clone(),
            table,
            guard,
            holding: false,
            unpublished: false,
            published_at: revision,
            view: None,
            history: History::new(revision, HISTORY_CAPACITY),
        }
    }

    /// Shows readers the table as it stands; false when they already saw it.
    fn publish(&mut self) -> bool {
        if !self.unpublished {
            return false;
        }
        self.published = self.table.clone();
        self.unpublished = false;
        self.view = None;
        true
    }
}

/// Worker changes held back from readers; dropping it publishes them ([`Registry::hold`]).
struct Hold<'a> {
    registry: &'a Registry,
}

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        self.registry.publish();
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
    /// Worker changes waiting for the writer ([`writer`]).
    jobs: writer::JobQueue,
    /// Held by the writer while it commits; closing waits for it.
    write_gate: tokio::sync::Mutex<()>,
    /// The store's events, applied by the follow task or by the writer after its own commits.
    events: Mutex<StoreEvents>,
    workers: RwLock<WorkerState>,
    requests: Mutex<IdTables>,
    /// The revision of the last worker change applied; writers wait on it.
    applied: tokio::sync::watch::Sender<Revision>,
    /// Told whenever readers are shown new worker changes; watchers wait on it.
    shown: tokio::sync::watch::Sender<()>,
    /// The store revision the tables are current at: worker changes, and with etcd also request
    /// ids and progress reports, so that every replica in sync reports the same revision. It
    /// only moves past a worker change while the workers lock is held for writing.
    revision: AtomicU64,
    /// The writer's batch sizes and flush times.
    write_stats: WriteStats,
    /// Workers removed because their lease ended, as the store reported them.
    lease_removals: AtomicU64,
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
        let (jobs, queued) = writer::queue();
        let registry = Arc::new(Registry {
            config,
            store,
            jobs,
            write_gate: tokio::sync::Mutex::new(()),
            events: Mutex::new(events),
            workers: RwLock::new(workers),
            requests: Mutex::new(requests),
            applied: tokio::sync::watch::Sender::new(revision),
            shown: tokio::sync::watch::Sender::new(()),
            revision: AtomicU64::new(revision),
            write_stats: WriteStats::new(),
            lease_removals: AtomicU64::new(0),
        });
        tokio::spawn(Self::follow(Arc::downgrade(&registry)));
        tokio::spawn(Self::run_writer(Arc::downgrade(&registry), queued));
        Ok(registry)
    }

    /// The settings the registry runs with.
    pub fn config(&self) -> &RegistryConfig {
        &self.config
    }

    /// What the writer measures: changes per batch and the time to make each batch durable.
    pub fn write_stats(&self) -> &WriteStats {
        &self.write_stats
    }

    fn check_rank(
        &self,
        kind: &'static str,
        rank: Rank,
        size: impl Fn(&ExpectedTopology) -> Rank,
    ) -> Result<(), RegistryError> {
        match &self.config.expected {
            Some(expected) if rank >= size(expected) => Err(RegistryError::OutOfRange {
                kind,
                rank,
                size: size(expected),
            }),
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

    /// Records one worker of an engine, under a new lease when it asks for one; a slot held by
    /// another engine (or by this one at another address) is taken over as the policy says.
    pub async fn register(
        self: &Arc<Self>,
        reg: &Registration,
    ) -> Result<Registered, RegistryError> {
        validate_id("engine_id", &reg.engine_id)?;
        validate_addr("addr", &reg.addr)?;
        if let Some(ttl) = reg.lease_ttl {
            validate_lease_ttl("lease_ttl", ttl)?;
        }
        self.check_slot(reg.slot)?;
        let lease = match reg.lease_ttl {
            Some(ttl) => Some(self.store.grant_lease(ttl).await?),
            None => None,
        };
        let takeover = self.config.engine_conflict == EngineConflictPolicy::Replace;
        let planned = reg.clone();
        let written = self
            .write(move |table, next_incarnation| {
                let plan = table.plan_register(&planned, lease, takeover, next_incarnation)?;
                // The leases of the workers this change removes or overwrites: revoked once no
                // worker lives by them (each registration grants a new lease).
                let superseded: Vec<Lease> = plan
                    .change
                    .remove
                    .iter()
                    .chain(plan.change.put.iter().map(|w| &w.slot))
                    .filter_map(|slot| table.get(*slot)?.lease)
                    .filter(|old| Some(*old) != lease)
                    .collect();
                Ok((plan.change, (plan.outcome, plan.incarnation, superseded)))
            })
            .await;
        let (outcome, incarnation, superseded) = match written {
            Ok(written) => written,
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
        for old in superseded {
            self.revoke_if_unused(Some(old));
        }
        let lease_id = lease.map(|l| l.id);
        let slot = reg.slot;
        match &outcome {
            RegisterOutcome::Created => {
                tracing::info!(engine_id = %reg.engine_id, %slot, addr = %reg.addr, incarnation, ?lease_id, "worker registered")
            }
            RegisterOutcome::TakenOver {
                previous_engine,
                previous_incarnation,
                removed,
            } => tracing::warn!(
                engine_id = %reg.engine_id, %slot, addr = %reg.addr, incarnation, ?lease_id,
                previous_engine = previous_engine.as_deref().unwrap_or("-"),
                previous_incarnation, removed,
                "engine takeover: {} (incarnation {previous_incarnation}) replaced by {} (incarnation {incarnation}); its {removed} worker(s) left",
                previous_engine.as_deref().unwrap_or("workers without an engine id"),
                reg.engine_id,
            ),
            RegisterOutcome::Replayed | RegisterOutcome::Renewed => {}
        }
        Ok(Registered {
            lease,
            incarnation,
            outcome,
        })
    }

    /// Records a worker without an engine id (vLLM's request-keyed `/register_worker`): the slot
    /// is written whatever it held, keeping the dp rank's engine id if it has one.
    pub async fn register_unowned(
        self: &Arc<Self>,
        slot: Slot,
        addr: &str,
    ) -> Result<(), RegistryError> {
        validate_addr("worker_addr", addr)?;
        self.check_slot(slot)?;
        let addr = addr.to_owned();
        self.write(move |table, _| Ok((table.plan_register_unowned(slot, &addr), ())))
            .await
    }

    /// Removes an engine's workers that match the selection; returns how many.
    pub async fn deregister(
        self: &Arc<Self>,
        req: &Deregistration,
    ) -> Result<usize, RegistryError> {
        validate_id("engine_id", &req.engine_id)?;
        let selection = req.clone();
        let removed = self
            .write(move |table, _| {
                let change = table.plan_deregister(&selection);
                let removed = change.remove.len();
                Ok((change, removed))
            })
            .await?;
        if removed > 0 {
            tracing::info!(engine_id = %req.engine_id, removed, "workers deregistered");
        }
        Ok(removed)
    }

    fn write_workers(&self) -> std::sync::RwLockWriteGuard<'_, WorkerState> {
        self.workers.write().unwrap_or_else(|e| e.into_inner())
    }

    fn read_workers(&self) -> std::sync::RwLockReadGuard<'_, WorkerState> {
        self.workers.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the worker table as it stands, including changes not yet durable, without taking
    /// a [`View`] of it: for a writer's checks, which must see every change planned before.
    pub fn inspect<R>(&self, read: impl FnOnce(&WorkerTable) -> R) -> R {
        read(&self.read_workers().table)
    }

    /// Holds worker changes back from readers until the returned guard is dropped (the
    /// writer, for the length of a batch that is not durable yet). Dropped however the batch
    /// ends, so readers are never left on an old table.
    fn hold(&self) -> Hold<'_> {
        let mut state = self.write_workers();
        if !state.holding {
            state.holding = true;
            state.published_at = self.revision();
        }
        Hold { registry: self }
    }

    /// Shows readers every change applied so far and wakes the watchers (the writer, once its
    /// batch is durable).
    fn publish(&self) {
        let mut state = self.write_workers();
        state.holding = false;
        let published = state.publish();
        drop(state);
        if published {
            self.shown.send_replace(());
        }
    }

    /// The revision readers are current at: the tables' own, unless changes are held back.
    fn visible_revision(&self, state: &WorkerState) -> Revision {
        if state.holding {
            state.published_at
        } else {
            self.revision()
        }
    }

    /// The worker table as far as it is durable, with its readiness; the same snapshot until
    /// the next change, so what a wire module renders from it can be kept with it
    /// ([`View::rendered`]).
    pub fn view(&self) -> Arc<View> {
        if let Some(view) = &self.read_workers().view {
            return view.clone();
        }
        let mut state = self.write_workers();
        if state.view.is_none() {
            let (expected, settle) = (self.config.expected, self.config.settle);
            state.view = Some(Arc::new(View::new(&state.published, expected, settle)));
        }
        state.view.clone().expect("the view was just made")
    }

    /// How complete the topology is.
    pub fn readiness(&self) -> Readiness {
        self.view().readiness()
    }

    /// Makes every buffered write durable and stops the store's background work (graceful
    /// shutdown). A worker change still running on its own task (its caller went away) is
    /// waited for first, for as long as a write may take, so none lands after the store closed.
    pub async fn close(&self) -> Result<(), StoreError> {
        let gate = tokio::time::timeout(
            writer::APPLY_WAIT + writer::CONFLICT_WAIT,
            self.write_gate.lock(),
        )
        .await;
        if gate.is_err() {
            tracing::warn!("a worker change was still running at shutdown");
        }
        // Held while the store closes: a change queued behind the gate would find it closed.
        let _gate = gate.ok();
        self.store.close().await
    }
}
