//! Where the registry keeps its state: one small async trait, so that the embedded sled store
//! ([`sled`](SledStore), one folder) and a distributed one ([`etcd`](EtcdStore), one folder) serve
//! the same [`Registry`](crate::registry::Registry). Both store the registry's own model
//! ([`crate::registry::model`]) with one [`codec`].

mod codec;
mod etcd;
mod sled;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

pub use etcd::{EtcdConfig, EtcdStore, REQUEST_LEASE_BUCKET_MS};
use pd_protocol::{LeaseId, Revision};
pub use sled::SledStore;

use crate::registry::model::{Lease, RequestRecord, Slot, WorkerChange, WorkerRecord};

/// A boxed future returned by [`Store`] methods.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A failure of the storage backend. The HTTP layer answers it with a 503: retrying may help.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The backend failed to read or write.
    #[error("storage backend failed: {0}")]
    Backend(String),
    /// Another writer changed the worker table since the caller planned its change: refresh
    /// and plan again.
    #[error("the worker table changed concurrently")]
    Conflict,
    /// A worker was to be written under a lease that has expired or was never granted.
    #[error("lease {0} is not live (expired or revoked)")]
    LeaseNotFound(LeaseId),
    /// Stored bytes could not be decoded (a corrupt or foreign database).
    #[error("stored record {key} is corrupt: {reason}")]
    Corrupt {
        /// The key of the record.
        key: String,
        /// Why it could not be decoded.
        reason: String,
    },
}

/// Everything a store holds, as of one revision.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// Every registered worker.
    pub workers: Vec<WorkerRecord>,
    /// Every request id mapping, expired ones included (the registry drops those).
    pub requests: Vec<(String, RequestRecord)>,
    /// The revision this snapshot is current at.
    pub revision: Revision,
    /// The revision of the last committed worker change (what [`Store::commit_workers`]
    /// compares against).
    pub guard: Revision,
}

/// A change the store reports, in commit order. The registry's in-memory tables follow these
/// events only, so changes made by other replicas and by lease expiry land the same way as its own.
#[derive(Debug)]
pub enum StoreEvent {
    /// Worker slots changed at `revision`: a commit (then `guard` is true) or an expired lease.
    Workers {
        /// The revision of the change.
        revision: Revision,
        /// Slots deleted.
        remove: Vec<Slot>,
        /// Workers written.
        put: Vec<WorkerRecord>,
        /// True when this was a [`Store::commit_workers`] (it moves the guard revision).
        guard: bool,
    },
    /// Request ids written or deleted by any replica (shared backends only).
    Requests {
        /// The revision of the change.
        revision: Revision,
        /// Ids written.
        put: Vec<(String, RequestRecord)>,
        /// Ids deleted (released or expired).
        remove: Vec<String>,
    },
    /// Nothing under this registry changed up to `revision` (shared backends only): replicas in
    /// sync report the same revision even while idle.
    Progress {
        /// The store's revision.
        revision: Revision,
    },
    /// The store lost its event history (e.g. an etcd watch fell behind compaction): the whole
    /// state again, to replace the tables with.
    Reset(Snapshot),
}

/// The receiving end of a store's events.
pub type StoreEvents = tokio::sync::mpsc::Receiver<StoreEvent>;

/// Storage of workers, leases and request ids, shared by one or more registry replicas.
///
/// Worker changes are durable once [`Store::sync`] resolves (they survive `kill -9`) and reach
/// every replica as [`StoreEvent`]s; request-id writes may be buffered until [`Store::close`] (they are
/// many, short-lived and re-creatable).
pub trait Store: Send + Sync + 'static {
    /// Reads everything stored.
    fn load(&self) -> StoreFuture<'_, Snapshot>;
    /// Starts reporting every change after revision `after`, in order. Called once.
    fn subscribe(&self, after: Revision) -> StoreEvents;
    /// Applies a worker change atomically, unless a worker change was committed after revision
    /// `guard` ([`StoreError::Conflict`]), and reports it. Returns the change's revision; the
    /// change is durable once [`Store::sync`] of that revision resolves.
    fn commit_workers<'a>(
        &'a self,
        change: &'a WorkerChange,
        guard: Revision,
    ) -> StoreFuture<'a, Revision>;
    /// How many slots one commit may change when the registry merges changes that arrive
    /// together into one: stores where a commit is a network round trip (etcd) merge; the
    /// embedded store does not (0), as there one worker is one cheap insert.
    fn merge_limit(&self) -> usize {
        0
    }
    /// Makes every worker change up to `revision` durable. Stores whose commits are durable
    /// when they return (etcd) have nothing to do; the embedded store flushes once for every
    /// change waiting (group commit).
    fn sync(&self, revision: Revision) -> StoreFuture<'_, ()> {
        let _ = revision;
        Box::pin(async { Ok(()) })
    }
    /// Grants a lease of about `ttl` seconds (a backend may round it up) for workers to be
    /// registered under.
    fn grant_lease(&self, ttl: u32) -> StoreFuture<'_, Lease>;
    /// Renews a lease; `None` when it has expired or was never granted.
    fn keep_alive(&self, lease: LeaseId) -> StoreFuture<'_, Option<u32>>;
    /// Ends a lease now, deleting every worker registered under it; false when it was not live.
    fn revoke_lease(&self, lease: LeaseId) -> StoreFuture<'_, bool>;
    /// How long a lease lives without another keepalive; `None` when it is not live.
    fn lease_remaining(&self, lease: LeaseId) -> StoreFuture<'_, Option<Duration>>;
    /// Records a request id mapping.
    fn put_request<'a>(&'a self, req_id: &'a str, record: RequestRecord) -> StoreFuture<'a, ()>;
    /// Forgets request id mappings (absent ones are ignored).
    fn remove_requests<'a>(&'a self, req_ids: &'a [Arc<str>]) -> StoreFuture<'a, ()>;
    /// Forgets request ids the registry found expired. Backends that expire ids themselves
    /// (etcd leases) do nothing.
    fn forget_expired<'a>(&'a self, req_ids: &'a [Arc<str>]) -> StoreFuture<'a, ()> {
        self.remove_requests(req_ids)
    }
    /// Whether the store is following every change right now (false while a shared store is
    /// unreachable: this replica then serves reads from what it last saw).
    fn connected(&self) -> bool {
        true
    }
    /// Makes every buffered write durable and stops the store's background work (graceful
    /// shutdown); the store reports no events afterwards.
    fn close(&self) -> StoreFuture<'_, ()>;
}
