//! The registry's one writer: every worker change is queued here and planned, committed and
//! applied by a single task, in order, as many at a time as are waiting; then one flush makes
//! them all durable, and only then are they answered (group commit).
//!
//! One task instead of a lock taken by each caller: when 64 workers register at once the
//! writer takes all 64 from the queue, commits them back to back without handing a lock from
//! task to task (each hand-off is a trip through the scheduler), and pays for one flush instead
//! of 64. Changes that arrive during the flush wait in the queue and form the next batch.

use std::sync::Weak;
use std::time::{Duration, Instant, SystemTime};

use pd_protocol::Revision;
use tokio::sync::{mpsc, oneshot};

use super::model::WorkerChange;
use super::write_stats::BatchTrace;
use super::{Registry, RegistryError, WorkerTable};
use crate::store::StoreError;

/// How often a worker change is planned again after another replica changed the table first.
const WRITE_ATTEMPTS: usize = 8;

/// How long a committed change may take to come back from the store before the write is
/// reported as failed (it is durable; a retry of the same registration is a no-op).
pub(super) const APPLY_WAIT: Duration = Duration::from_secs(10);

/// How long a write that lost a race waits for the winner's change to arrive.
pub(super) const CONFLICT_WAIT: Duration = Duration::from_secs(2);

/// How many changes may wait for the writer before callers wait to queue theirs.
pub(super) const QUEUE_CAPACITY: usize = 4096;

/// How many waiting changes the writer takes at once.
const BATCH: usize = 256;

/// How many changes one merged commit holds at most (a registration is one or two slots; the
/// merged change must also fit the store's limit, or its jobs are committed one by one).
const MERGED_JOBS: usize = 32;

/// A queued worker change: how to plan it against the table, and where its outcome goes.
pub(super) trait Job: Send {
    /// Plans the change against `table` (a new incarnation is `next_incarnation`), keeping
    /// what it will answer.
    fn plan(
        &mut self,
        table: &WorkerTable,
        next_incarnation: u64,
    ) -> Result<WorkerChange, RegistryError>;
    /// Answers the caller once the change is durable, or tells why it was not made.
    fn finish(self: Box<Self>, result: Result<(), RegistryError>);
}

/// Jobs of a batch whose commit is settled, each with the revision to make durable before
/// it is answered, or why it failed.
type Committed = Vec<(Box<dyn Job>, Result<Revision, RegistryError>)>;

/// The queue's sending end, kept by the registry.
pub(super) type JobQueue = mpsc::Sender<Box<dyn Job>>;

/// A change planned by `P`, answering with `T`.
struct Planned<T, P> {
    plan: P,
    outcome: Option<T>,
    reply: oneshot::Sender<Result<T, RegistryError>>,
}

impl<T, P> Job for Planned<T, P>
where
    T: Send + 'static,
    P: Fn(&WorkerTable, u64) -> Result<(WorkerChange, T), RegistryError> + Send + 'static,
{
    fn plan(
        &mut self,
        table: &WorkerTable,
        next_incarnation: u64,
    ) -> Result<WorkerChange, RegistryError> {
        let (change, outcome) = (self.plan)(table, next_incarnation)?;
        self.outcome = Some(outcome);
        Ok(change)
    }

    fn finish(self: Box<Self>, result: Result<(), RegistryError>) {
        let Planned { outcome, reply, .. } = *self;
        let answer = result.and_then(|()| outcome.ok_or_else(closed));
        // A caller that went away no longer needs the answer; the change stands.
        let _ = reply.send(answer);
    }
}

fn closed() -> RegistryError {
    RegistryError::Store(StoreError::Backend(
        "the registry's writer has stopped".to_owned(),
    ))
}

impl Registry {
    /// Queues a worker change planned by `plan` against the table as it will stand when its
    /// turn comes; returns once the change is in this replica's tables and durable. A caller
    /// that goes away (client disconnect, request timeout) cannot cut a change in half: the
    /// writer makes it whole or not at all. When another replica changed the table first, the
    /// plan is made again on the fresher table (a bounded number of times).
    ///
    /// The writer makes the batch durable with one [`Store::sync`](crate::store::Store::sync)
    /// after committing all of it, and with sled it must: a flush and a commit exclude each
    /// other there (a commit takes sled's global write lock, a flush holds it shared while the
    /// disk works), so a flush started between two commits of a batch would hold the rest of
    /// the batch back for a whole disk write.
    pub(super) async fn write<T, P>(&self, plan: P) -> Result<T, RegistryError>
    where
        T: Send + 'static,
        P: Fn(&WorkerTable, u64) -> Result<(WorkerChange, T), RegistryError> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let job = Box::new(Planned {
            plan,
            outcome: None,
            reply,
        });
        self.jobs.send(job).await.map_err(|_| closed())?;
        answer.await.map_err(|_| closed())?
    }

    /// The writer task: takes the waiting changes, commits them one after another, makes them
    /// durable with one flush and answers them, until the registry goes away. Holds the write
    /// gate while it works, so that closing the registry waits for a batch in progress.
    pub(super) async fn run_writer(
        registry: Weak<Registry>,
        mut jobs: mpsc::Receiver<Box<dyn Job>>,
    ) {
        let mut batch = Vec::with_capacity(BATCH);
        let mut committed = Vec::with_capacity(BATCH);
        while jobs.recv_many(&mut batch, BATCH).await > 0 {
            let Some(registry) = registry.upgrade() else {
                return;
            };
            let _gate = registry.write_gate.lock().await;
            // Readers see the batch's changes only once they are durable.
            let held = registry.hold();
            // With traces on, the batch is a span: when it began, and its commits' time.
            let traced = pd_service::traces::enabled().then(|| (SystemTime::now(), Instant::now()));
            registry.commit_batch(&mut batch, &mut committed).await;
            let traced = traced.map(|(began, commit_started)| (began, commit_started.elapsed()));
            let durable_at = committed
                .iter()
                .filter_map(|(_, result)| result.as_ref().ok())
                .fold(0, |last, revision| last.max(*revision));
            let flush_started = Instant::now();
            let synced = registry.store.sync(durable_at).await;
            let flush = flush_started.elapsed();
            if durable_at > 0 {
                registry.write_stats.observe_batch(committed.len(), flush);
            }
            if let Some((began, commit)) = traced {
                let failed = committed.iter().filter(|(_, r)| r.is_err()).count();
                let trace = BatchTrace {
                    started: began,
                    commit,
                    flush,
                    writes: committed.len(),
                    failed,
                    revision: durable_at,
                    flush_error: synced.as_ref().err().map(ToString::to_string),
                };
                trace.record();
            }
            // Published also when the flush failed (each caller is told it failed): the table
            // holds the changes either way, later changes are planned on them, and the next
            // batch would show them.
            drop(held);
            for (job, result) in committed.drain(..) {
                let durable = synced.clone().map_err(RegistryError::from);
                job.finish(result.and(durable));
            }
        }
    }

    /// Commits every job of `batch` into `committed`: one by one, or, where the store merges
    /// (etcd), as merged commits of up to [`MERGED_JOBS`] jobs each.
    async fn commit_batch(&self, batch: &mut Vec<Box<dyn Job>>, committed: &mut Committed) {
        let limit = self.store.merge_limit();
        while !batch.is_empty() {
            let take = if limit == 0 { 1 } else { MERGED_JOBS };
            let mut group: Vec<Box<dyn Job>> = batch.drain(..take.min(batch.len())).collect();
            if group.len() > 1 {
                self.commit_merged(&mut group, limit, committed).await;
            }
            for mut job in group {
                let result = self.commit(job.as_mut()).await;
                committed.push((job, result));
            }
        }
    }

    /// Plans the jobs of `group` one after another on a copy of the table, each seeing the
    /// ones before it, and commits them as one change (one round trip to the store instead of
    /// one each). Jobs it settles go to `committed`; the ones it leaves in `group` are to be
    /// committed one by one: all of them when the merged change is too large, refers to a
    /// lease that has expired, or lost a race with another replica.
    async fn commit_merged(
        &self,
        group: &mut Vec<Box<dyn Job>>,
        limit: usize,
        committed: &mut Committed,
    ) {
        let (mut table, guard) = {
            let state = self.read_workers();
            (state.table.clone(), state.guard)
        };
        let mut merged = WorkerChange::default();
        let mut planned = Vec::with_capacity(group.len());
        for mut job in group.drain(..) {
            // One commit, one new incarnation for all: an engine registered twice in the group
            // keeps the first one's.
            match job.plan(&table, guard + 1) {
                Ok(change) => {
                    table.apply(&change);
                    merged = merged.then(change);
                    planned.push(job);
                }
                Err(err) => committed.push((job, Err(err))),
            }
        }
        let outcome = match merged.len() {
            0 => Ok(self.revision()),
            size if size > limit => Err(StoreError::Conflict),
            _ => self.store.commit_workers(&merged, guard).await,
        };
        match outcome {
            Ok(revision) => {
                let applied = self.wait_applied(revision).await.map(|()| revision);
                for job in planned {
                    committed.push((job, applied.clone().map_err(RegistryError::from)));
                }
            }
            Err(StoreError::Conflict | StoreError::LeaseNotFound(_)) => *group = planned,
            Err(err) => {
                for job in planned {
                    committed.push((job, Err(err.clone().into())));
                }
            }
        }
    }

    /// Plans and commits one change; the revision that must be durable before it is
    /// acknowledged (for a change that turned out empty, what the plan read, which may not be
    /// on disk yet either).
    async fn commit(&self, job: &mut dyn Job) -> Result<Revision, RegistryError> {
        for _ in 0..WRITE_ATTEMPTS {
            let (guard, read_at, change) = {
                let state = self.read_workers();
                // A new incarnation is greater than every one on record: the table's
                // incarnations were all planned against older guards.
                let change = job.plan(&state.table, state.guard + 1)?;
                (state.guard, self.revision(), change)
            };
            if change.is_empty() {
                return Ok(read_at);
            }
            match self.store.commit_workers(&change, guard).await {
                Ok(revision) => {
                    // The embedded store has reported the change by now: applied here, the
                    // next change is planned on it without a trip through the follow task.
                    self.catch_up();
                    self.wait_applied(revision).await?;
                    return Ok(revision);
                }
                Err(StoreError::Conflict) => self.wait_guard_moved(guard).await,
                Err(err) => return Err(err.into()),
            }
        }
        Err(RegistryError::Store(StoreError::Conflict))
    }

    /// Waits until this replica has applied `revision`.
    async fn wait_applied(&self, revision: Revision) -> Result<(), StoreError> {
        let mut applied = self.applied.subscribe();
        let reached = applied.wait_for(|r| *r >= revision);
        let in_time = matches!(tokio::time::timeout(APPLY_WAIT, reached).await, Ok(Ok(_)));
        if in_time {
            return Ok(());
        }
        Err(StoreError::Backend(format!(
            "the change was stored at revision {revision} but has not reached this replica yet"
        )))
    }

    /// Waits (briefly) until a worker change newer than `guard` has been applied.
    async fn wait_guard_moved(&self, guard: Revision) {
        let mut applied = self.applied.subscribe();
        let moved = applied.wait_for(|_| self.read_workers().guard != guard);
        let _ = tokio::time::timeout(CONFLICT_WAIT, moved).await;
    }
}

/// A new queue for a registry's writer.
pub(super) fn queue() -> (JobQueue, mpsc::Receiver<Box<dyn Job>>) {
    mpsc::channel(QUEUE_CAPACITY)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use pd_protocol::LeaseId;
    use tokio::sync::Notify;

    use super::*;
    use crate::registry::model::{Lease, Registration, RequestRecord, Slot};
    use crate::registry::RegistryConfig;
    use crate::store::{SledStore, Snapshot, Store, StoreEvents, StoreFuture};

    /// The embedded store, whose flushes wait until the test lets them go.
    struct HeldFlush {
        inner: SledStore,
        flushing: Notify,
        release: Notify,
    }

    impl Store for HeldFlush {
        fn load(&self) -> StoreFuture<'_, Snapshot> {
            self.inner.load()
        }
        fn subscribe(&self, after: Revision) -> StoreEvents {
            self.inner.subscribe(after)
        }
        fn commit_workers<'a>(
            &'a self,
            change: &'a WorkerChange,
            guard: Revision,
        ) -> StoreFuture<'a, Revision> {
            self.inner.commit_workers(change, guard)
        }
        fn sync(&self, revision: Revision) -> StoreFuture<'_, ()> {
            Box::pin(async move {
                self.flushing.notify_one();
                self.release.notified().await;
                self.inner.sync(revision).await
            })
        }
        fn grant_lease(&self, ttl: u32) -> StoreFuture<'_, Lease> {
            self.inner.grant_lease(ttl)
        }
        fn keep_alive(&self, lease: LeaseId) -> StoreFuture<'_, Option<u32>> {
            self.inner.keep_alive(lease)
        }
        fn revoke_lease(&self, lease: LeaseId) -> StoreFuture<'_, bool> {
            self.inner.revoke_lease(lease)
        }
        fn lease_remaining(&self, lease: LeaseId) -> StoreFuture<'_, Option<std::time::Duration>> {
            self.inner.lease_remaining(lease)
        }
        fn put_request<'a>(
            &'a self,
            req_id: &'a str,
            record: RequestRecord,
        ) -> StoreFuture<'a, ()> {
            self.inner.put_request(req_id, record)
        }
        fn remove_requests<'a>(&'a self, req_ids: &'a [Arc<str>]) -> StoreFuture<'a, ()> {
            self.inner.remove_requests(req_ids)
        }
        fn close(&self) -> StoreFuture<'_, ()> {
            self.inner.close()
        }
    }

    /// Where a watcher from `since` stands after a short wait, and how many changes it got.
    async fn watched(registry: &Registry, since: Revision) -> (Revision, usize) {
        let changes = registry
            .watch(since, Duration::from_millis(50))
            .await
            .expect("watch");
        (changes.revision, changes.changes.len())
    }

    #[tokio::test]
    async fn readers_and_watchers_see_a_change_only_once_it_is_durable() {
        let dir = tempfile::tempdir().expect("a data folder");
        let store = Arc::new(HeldFlush {
            inner: SledStore::open(dir.path()).expect("open sled"),
            flushing: Notify::new(),
            release: Notify::new(),
        });
        let registry = Registry::open(store.clone(), RegistryConfig::default())
            .await
            .expect("open the registry");
        let (since, workers) = registry.list();
        assert!(workers.is_empty());
        let slot = Slot {
            dp: 0,
            cp: 0,
            tp: 0,
            pp: 0,
        };
        let registration = Registration {
            engine_id: "engine-a".to_owned(),
            slot,
            addr: "tcp://10.0.0.1:7000".to_owned(),
            replace: None,
            lease_ttl: None,
            meta: Default::default(),
            extra: Default::default(),
        };
        let registering = tokio::spawn({
            let registry = registry.clone();
            async move { registry.register(&registration).await }
        });

        // Committed and applied, its flush not done: the writer plans on it, readers do not
        // see it yet.
        store.flushing.notified().await;
        assert!(registry.inspect(|table| table.get(slot).is_some()));
        assert_eq!(registry.list(), (since, Vec::new()));
        assert_eq!(registry.view().table().worker_count(), 0);
        assert_eq!(watched(&registry, since).await, (since, 0));

        store.release.notify_one();
        registering
            .await
            .expect("the registration task")
            .expect("registered");
        let (revision, workers) = registry.list();
        assert!(revision > since);
        assert_eq!(workers.len(), 1);
        assert_eq!(registry.view().table().worker_count(), 1);
        assert_eq!(watched(&registry, since).await, (revision, 1));
    }
}
