//! The embedded default store: a sled database in `--data-dir`.
//!
//! Two trees: `workers` (key: dp, tp, pp as big-endian u32s; value: JSON, with the revision of
//! the change that wrote it; plus the key `revision` holding the revision of the last change
//! written as a batch) and `requests` (key: the request id; value: dp rank and expiry as
//! big-endian integers). A change of one worker (a registration, the common case) is one
//! insert: sled writes every batch to its log as soon as it is applied, several disk writes
//! each, so only changes of several keys (removals, takeovers, drain marks) are batches. The
//! last revision is the largest of the `revision` key and the records' own. Worker commits are flushed to disk before they are
//! acknowledged; request ids are flushed by sled every `flush_every_ms` and on [`Store::close`]
//! (graceful shutdown). Leases live in memory ([`SledLeases`]) and expire on a background task.

mod leases;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use pd_protocol::{LeaseId, Revision};
use tokio::sync::mpsc;

use self::leases::SledLeases;
use super::codec::{corrupt, decode_request, decode_worker, encode_request, encode_worker};
use super::{Snapshot, Store, StoreError, StoreEvent, StoreEvents, StoreFuture};
use crate::registry::model::{Lease, RequestRecord, Slot, WorkerChange};
use crate::sync::lock;

/// How often sled writes buffered request ids to disk on its own.
const BACKGROUND_FLUSH_MS: u64 = 200;

/// Memory sled may use for its page cache.
const CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// The key (in the workers tree) of the last worker change's revision.
const REVISION_KEY: &[u8] = b"revision";

/// How often expired leases are looked for.
const LEASE_SWEEP: Duration = Duration::from_millis(100);

/// How many store events may wait for the registry before commits wait.
const EVENT_BUFFER: usize = 1024;

/// The sled-backed [`Store`].
pub struct SledStore {
    inner: Arc<Inner>,
    /// The lease sweeper, and how to stop it.
    sweeper: Mutex<Option<tokio::task::JoinHandle<()>>>,
    stop_sweeper: Arc<tokio::sync::Notify>,
}

struct Inner {
    db: sled::Db,
    workers: sled::Tree,
    requests: sled::Tree,
    /// Serializes worker commits and lease expiry, so that revisions and events stay in order.
    commits: tokio::sync::Mutex<CommitState>,
    leases: Mutex<SledLeases>,
    /// Where events go once the registry has subscribed.
    events: Mutex<Option<mpsc::Sender<StoreEvent>>>,
    /// The revision of the last worker change applied to the database.
    applied: AtomicU64,
    /// The revision up to which worker changes are on disk.
    durable: AtomicU64,
    /// Held by the one flush running; writes arriving meanwhile share the next one.
    flushing: tokio::sync::Mutex<()>,
}

struct CommitState {
    revision: Revision,
    guard: Revision,
}

fn backend(err: sled::Error) -> StoreError {
    StoreError::Backend(err.to_string())
}

/// A worker's key: dp, tp, pp as big-endian u32s, and cp after them when it is not 0 (so the
/// keys of databases written before cp ranks existed stay what they were).
fn slot_key(slot: Slot) -> Vec<u8> {
    let mut key = Vec::with_capacity(16);
    for rank in [slot.dp, slot.tp, slot.pp] {
        key.extend_from_slice(&rank.to_be_bytes());
    }
    if slot.cp != 0 {
        key.extend_from_slice(&slot.cp.to_be_bytes());
    }
    key
}

fn decode_slot(key: &[u8]) -> Option<Slot> {
    let word = |i: usize| Some(u32::from_be_bytes(key.get(i..i + 4)?.try_into().ok()?));
    let cp = match key.len() {
        12 => 0,
        16 => word(12).filter(|cp| *cp != 0)?,
        _ => return None,
    };
    Some(Slot {
        dp: word(0)?,
        cp,
        tp: word(4)?,
        pp: word(8)?,
    })
}

/// The revision of the last worker change in `workers`: the largest of the `revision` key
/// (written with every batch) and the revisions the records were written at.
fn last_revision(workers: &sled::Tree) -> Result<Revision, StoreError> {
    let mut revision = 0;
    for entry in workers.iter() {
        let (key, value) = entry.map_err(backend)?;
        let written_at = if key.as_ref() == REVISION_KEY {
            let bytes = value.as_ref().try_into();
            u64::from_be_bytes(bytes.map_err(|_| corrupt(REVISION_KEY, "bad revision"))?)
        } else {
            let slot = decode_slot(&key).ok_or_else(|| corrupt(&key, "bad worker key"))?;
            decode_worker(slot, &key, &value)?.1
        };
        revision = revision.max(written_at);
    }
    Ok(revision)
}

impl SledStore {
    /// Opens (or creates) the database in `dir`.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(CACHE_BYTES)
            .flush_every_ms(Some(BACKGROUND_FLUSH_MS))
            .open()
            .map_err(backend)?;
        let workers = db.open_tree("workers").map_err(backend)?;
        let requests = db.open_tree("requests").map_err(backend)?;
        let revision = last_revision(&workers)?;
        Ok(SledStore {
            inner: Arc::new(Inner {
                db,
                workers,
                requests,
                commits: tokio::sync::Mutex::new(CommitState {
                    revision,
                    guard: revision,
                }),
                leases: Mutex::new(SledLeases::default()),
                events: Mutex::new(None),
                applied: AtomicU64::new(revision),
                durable: AtomicU64::new(revision),
                flushing: tokio::sync::Mutex::new(()),
            }),
            sweeper: Mutex::new(None),
            stop_sweeper: Arc::new(tokio::sync::Notify::new()),
        })
    }
}

impl Inner {
    fn leases(&self) -> std::sync::MutexGuard<'_, SledLeases> {
        lock(&self.leases)
    }

    fn load_sync(&self, revision: Revision) -> Result<Snapshot, StoreError> {
        let mut state = Snapshot {
            revision,
            guard: revision,
            ..Snapshot::default()
        };
        let now = Instant::now();
        let mut leases = self.leases();
        for entry in self.workers.iter() {
            let (key, value) = entry.map_err(backend)?;
            if key.as_ref() == REVISION_KEY {
                continue;
            }
            let slot = decode_slot(&key).ok_or_else(|| corrupt(&key, "bad worker key"))?;
            let (worker, _) = decode_worker(slot, &key, &value)?;
            if let Some(lease) = worker.lease {
                leases.restore(lease.id, lease.ttl, slot, now);
            }
            state.workers.push(worker);
        }
        for entry in self.requests.iter() {
            let (key, value) = entry.map_err(backend)?;
            let id = String::from_utf8(key.to_vec()).map_err(|_| corrupt(&key, "non-UTF-8 id"))?;
            let record =
                decode_request(&value).ok_or_else(|| corrupt(&key, "bad request value"))?;
            state.requests.push((id, record));
        }
        Ok(state)
    }

    /// Writes a worker change as of `revision`: one insert for one worker, a batch otherwise.
    fn write_change(&self, change: &WorkerChange, revision: Revision) -> Result<(), StoreError> {
        if let ([], [worker]) = (change.remove.as_slice(), change.put.as_slice()) {
            let value = encode_worker(worker, revision);
            self.workers
                .insert(slot_key(worker.slot), value)
                .map_err(backend)?;
            return Ok(());
        }
        let mut batch = sled::Batch::default();
        for slot in &change.remove {
            batch.remove(slot_key(*slot));
        }
        for worker in &change.put {
            batch.insert(slot_key(worker.slot), encode_worker(worker, revision));
        }
        batch.insert(REVISION_KEY, &revision.to_be_bytes());
        self.workers.apply_batch(batch).map_err(backend)
    }

    /// Writes a worker change durably and reports it. The caller holds the commit lock.
    async fn commit_locked(
        &self,
        state: &mut CommitState,
        change: WorkerChange,
        guard: bool,
    ) -> Result<Revision, StoreError> {
        if let Some(dead) = change
            .put
            .iter()
            .filter_map(|w| w.lease)
            .find(|lease| !self.leases().is_live(lease.id))
        {
            return Err(StoreError::LeaseNotFound(dead.id));
        }
        let revision = state.revision + 1;
        self.write_change(&change, revision)?;
        // Applied: from here the change is in the database (durable at the next flush: `sync`,
        // or sled's own background flush), so the revision moves and the change is reported.
        self.applied.store(revision, Ordering::Release);
        state.revision = revision;
        if guard {
            state.guard = revision;
        }
        self.leases().track(&change);
        let events = lock(&self.events).clone();
        if let Some(events) = events {
            // A registry that went away no longer needs the event.
            let _ = events
                .send(StoreEvent::Workers {
                    revision,
                    remove: change.remove,
                    put: change.put,
                    guard,
                })
                .await;
        }
        Ok(revision)
    }

    /// Makes every change up to `revision` durable: one flush covers every change applied
    /// before it started, so concurrent writers share flushes (group commit).
    async fn sync(&self, revision: Revision) -> Result<(), StoreError> {
        if self.durable.load(Ordering::Acquire) >= revision {
            return Ok(());
        }
        let _flushing = self.flushing.lock().await;
        if self.durable.load(Ordering::Acquire) >= revision {
            return Ok(());
        }
        let covered = self.applied.load(Ordering::Acquire);
        self.workers.flush_async().await.map_err(backend)?;
        self.durable.fetch_max(covered, Ordering::AcqRel);
        Ok(())
    }

    /// Deletes the slots of `lease` (revoked or expired).
    async fn drop_lease_slots(
        &self,
        state: &mut CommitState,
        lease: LeaseId,
        slots: Vec<Slot>,
    ) -> Result<(), StoreError> {
        if slots.is_empty() {
            return Ok(());
        }
        tracing::info!(
            lease,
            workers = slots.len(),
            "lease ended, its workers are removed"
        );
        let change = WorkerChange {
            remove: slots.clone(),
            put: Vec::new(),
        };
        let removed = match self.commit_locked(state, change, false).await {
            Ok(revision) => self.sync(revision).await,
            Err(err) => Err(err),
        };
        if removed.is_err() {
            // The lease is gone; its workers must still go: the sweeper tries again.
            self.leases().retry_removal(lease, slots);
        }
        removed
    }

    /// Removes the workers of expired leases until `stop` is notified or the store is dropped.
    async fn expire_leases(inner: Weak<Inner>, stop: Arc<tokio::sync::Notify>) {
        let mut tick = tokio::time::interval(LEASE_SWEEP);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = stop.notified() => return,
            }
            let Some(inner) = inner.upgrade() else { return };
            let mut state = inner.commits.lock().await;
            let expired = inner.leases().take_expired(Instant::now());
            for (lease, slots) in expired {
                if let Err(err) = inner.drop_lease_slots(&mut state, lease, slots).await {
                    // Tried again at the next sweep.
                    tracing::error!(lease, error = %err, "could not remove an expired lease's workers");
                }
            }
        }
    }
}

impl Store for SledStore {
    fn load(&self) -> StoreFuture<'_, Snapshot> {
        Box::pin(async move {
            let state = self.inner.commits.lock().await;
            self.inner.load_sync(state.revision)
        })
    }

    fn subscribe(&self, _after: Revision) -> StoreEvents {
        // Every change after the load is reported: the registry loads and subscribes before it
        // serves, and nothing else writes to the embedded store.
        let (sender, receiver) = mpsc::channel(EVENT_BUFFER);
        *lock(&self.inner.events) = Some(sender);
        let sweeper = tokio::spawn(Inner::expire_leases(
            Arc::downgrade(&self.inner),
            self.stop_sweeper.clone(),
        ));
        *lock(&self.sweeper) = Some(sweeper);
        receiver
    }

    fn commit_workers<'a>(
        &'a self,
        change: &'a WorkerChange,
        guard: Revision,
    ) -> StoreFuture<'a, Revision> {
        Box::pin(async move {
            let mut state = self.inner.commits.lock().await;
            if state.guard != guard {
                return Err(StoreError::Conflict);
            }
            self.inner
                .commit_locked(&mut state, change.clone(), true)
                .await
        })
    }

    fn sync(&self, revision: Revision) -> StoreFuture<'_, ()> {
        Box::pin(self.inner.sync(revision))
    }

    fn grant_lease(&self, ttl: u32) -> StoreFuture<'_, Lease> {
        Box::pin(async move {
            let id = self.inner.leases().grant(ttl, Instant::now());
            Ok(Lease { id, ttl })
        })
    }

    fn keep_alive(&self, lease: LeaseId) -> StoreFuture<'_, Option<u32>> {
        Box::pin(async move { Ok(self.inner.leases().keep_alive(lease, Instant::now())) })
    }

    fn revoke_lease(&self, lease: LeaseId) -> StoreFuture<'_, bool> {
        Box::pin(async move {
            let mut state = self.inner.commits.lock().await;
            let Some(slots) = self.inner.leases().revoke(lease) else {
                return Ok(false);
            };
            self.inner
                .drop_lease_slots(&mut state, lease, slots)
                .await?;
            Ok(true)
        })
    }

    fn lease_remaining(&self, lease: LeaseId) -> StoreFuture<'_, Option<Duration>> {
        let remaining = self.inner.leases().remaining(lease, Instant::now());
        Box::pin(async move { Ok(remaining) })
    }

    fn put_request<'a>(&'a self, req_id: &'a str, record: RequestRecord) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.inner
                .requests
                .insert(req_id.as_bytes(), &encode_request(record))
                .map_err(backend)?;
            Ok(())
        })
    }

    fn remove_requests<'a>(&'a self, req_ids: &'a [Arc<str>]) -> StoreFuture<'a, ()> {
        // One remove each: the ids are independent, and a sled batch would be written to disk
        // at once and wait for any flush in progress (see the module's documentation).
        Box::pin(async move {
            for id in req_ids {
                self.inner.requests.remove(id.as_bytes()).map_err(backend)?;
            }
            Ok(())
        })
    }

    fn close(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            // Stopped and awaited, so nothing holds the database open once the store is dropped
            // (a restart in the same process can lock it again at once).
            self.stop_sweeper.notify_one();
            let sweeper = lock(&self.sweeper).take();
            if let Some(sweeper) = sweeper {
                let _ = sweeper.await;
            }
            lock(&self.inner.events).take();
            self.inner.db.flush_async().await.map_err(backend)?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::registry::model::WorkerRecord;

    #[test]
    fn keys_round_trip() {
        let slot = Slot {
            dp: 3,
            cp: 0,
            tp: 65_535,
            pp: 1,
        };
        assert_eq!(decode_slot(&slot_key(slot)), Some(slot));
        assert_eq!(slot_key(slot).len(), 12, "cp 0 keeps the old key");
        let with_cp = Slot { cp: 2, ..slot };
        assert_eq!(decode_slot(&slot_key(with_cp)), Some(with_cp));
        assert_eq!(decode_slot(&[1, 2, 3]), None);
    }

    fn worker(dp: u32, lease: Option<Lease>) -> WorkerRecord {
        WorkerRecord {
            slot: Slot {
                dp,
                cp: 0,
                tp: 0,
                pp: 0,
            },
            engine_id: Some(Arc::from("e1")),
            addr: "tcp://127.0.0.1:9".into(),
            lease,
            incarnation: 0,
            meta: Default::default(),
            extra: Default::default(),
            draining: false,
        }
    }

    fn put(worker: &WorkerRecord) -> WorkerChange {
        WorkerChange {
            remove: vec![],
            put: vec![worker.clone()],
        }
    }

    #[tokio::test]
    async fn state_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let record = RequestRecord {
            dp_rank: 1,
            expires_at_ms: 42,
        };
        let (plain, leased);
        {
            let store = SledStore::open(dir.path()).unwrap();
            let lease = store.grant_lease(30).await.unwrap();
            plain = worker(1, None);
            leased = worker(2, Some(lease));
            assert_eq!(store.commit_workers(&put(&plain), 0).await.unwrap(), 1);
            assert_eq!(store.commit_workers(&put(&leased), 1).await.unwrap(), 2);
            store.put_request("r1", record).await.unwrap();
            store.put_request("r2", record).await.unwrap();
            store.remove_requests(&[Arc::from("r2")]).await.unwrap();
            store.close().await.unwrap();
        }
        let store = SledStore::open(dir.path()).unwrap();
        let state = store.load().await.unwrap();
        assert_eq!(state.workers, vec![plain, leased.clone()]);
        assert_eq!(state.requests, vec![("r1".to_owned(), record)]);
        assert_eq!((state.revision, state.guard), (2, 2));
        // The lease came back with the worker.
        let lease = leased.lease.unwrap();
        assert_eq!(store.keep_alive(lease.id).await.unwrap(), Some(30));
    }

    /// A one-worker change is a single record carrying its revision and a removal is a batch
    /// carrying the `revision` key: after a reopen the revision is the last one either way.
    #[tokio::test]
    async fn the_revision_survives_reopen_whichever_change_came_last() {
        let dir = tempfile::tempdir().unwrap();
        let remove = |dp| WorkerChange {
            remove: vec![worker(dp, None).slot],
            put: Vec::new(),
        };
        let changes = [put(&worker(1, None)), put(&worker(2, None)), remove(1)];
        let mut revision = 0;
        for (step, change) in changes.iter().enumerate() {
            {
                let store = SledStore::open(dir.path()).unwrap();
                assert_eq!(store.load().await.unwrap().revision, revision);
                revision = store.commit_workers(change, revision).await.unwrap();
                store.sync(revision).await.unwrap();
                assert_eq!(revision, step as u64 + 1);
                // Closed, so the database is free to open again at once (a store merely
                // dropped lets go of it when sled's threads are done with it).
                store.close().await.unwrap();
            }
            let store = SledStore::open(dir.path()).unwrap();
            let state = store.load().await.unwrap();
            assert_eq!((state.revision, state.guard), (revision, revision));
            store.close().await.unwrap();
        }
        let store = SledStore::open(dir.path()).unwrap();
        let slots: Vec<u32> = store
            .load()
            .await
            .unwrap()
            .workers
            .iter()
            .map(|w| w.slot.dp)
            .collect();
        assert_eq!(slots, vec![2]);
    }

    #[tokio::test]
    async fn stale_guards_and_dead_leases_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        store
            .commit_workers(&put(&worker(0, None)), 0)
            .await
            .unwrap();
        assert!(matches!(
            store.commit_workers(&put(&worker(1, None)), 0).await,
            Err(StoreError::Conflict)
        ));
        let dead = Lease { id: 12345, ttl: 5 };
        assert!(matches!(
            store.commit_workers(&put(&worker(1, Some(dead))), 1).await,
            Err(StoreError::LeaseNotFound(12345))
        ));
    }

    #[tokio::test]
    async fn expired_and_revoked_leases_delete_their_workers_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(dir.path()).unwrap();
        let mut events = store.subscribe(0);
        let short = store.grant_lease(1).await.unwrap();
        let long = store.grant_lease(60).await.unwrap();
        let short_worker = worker(0, Some(short));
        let long_worker = worker(1, Some(long));
        let (short, long) = (short.id, long.id);
        store.commit_workers(&put(&short_worker), 0).await.unwrap();
        store.commit_workers(&put(&long_worker), 1).await.unwrap();
        for revision in [1, 2] {
            assert!(matches!(
                events.recv().await.unwrap(),
                StoreEvent::Workers { revision: r, guard: true, .. } if r == revision
            ));
        }
        let expired = tokio::time::timeout(Duration::from_secs(3), events.recv())
            .await
            .expect("the short lease expires within its ttl and a sweep")
            .unwrap();
        assert!(matches!(
            expired,
            StoreEvent::Workers { revision: 3, ref remove, guard: false, .. } if remove == &[short_worker.slot]
        ));
        assert_eq!(store.keep_alive(short).await.unwrap(), None);
        assert!(store.revoke_lease(long).await.unwrap());
        assert!(!store.revoke_lease(long).await.unwrap());
        assert!(matches!(
            events.recv().await.unwrap(),
            StoreEvent::Workers { revision: 4, ref remove, .. } if remove == &[long_worker.slot]
        ));
        assert!(store.load().await.unwrap().workers.is_empty());
    }
}
