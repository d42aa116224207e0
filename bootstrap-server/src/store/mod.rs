//! Where the registry keeps its state: a small async trait, so that the embedded sled store and a
//! distributed one (etcd) serve the same [`Registry`](crate::registry::Registry).

mod sled_store;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

pub use sled_store::SledStore;
use worker_client::protocol::Rank;

/// A boxed future returned by [`Store`] methods.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A failure of the storage backend. The HTTP layer answers it with a 503: retrying may help.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The backend failed to read or write.
    #[error("storage backend failed: {0}")]
    Backend(String),
    /// Stored bytes could not be decoded (a corrupt or foreign database).
    #[error("stored record {key} is corrupt: {reason}")]
    Corrupt {
        /// The key of the record.
        key: String,
        /// Why it could not be decoded.
        reason: String,
    },
}

/// The (dp, tp, pp) position of one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot {
    /// Data-parallel rank.
    pub dp: Rank,
    /// Tensor-parallel rank.
    pub tp: Rank,
    /// Pipeline-parallel rank.
    pub pp: Rank,
}

impl std::fmt::Display for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "dp_rank={}, tp_rank={}, pp_rank={}",
            self.dp, self.tp, self.pp
        )
    }
}

/// One registered worker as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerRecord {
    /// Its position.
    pub slot: Slot,
    /// The engine that owns its dp rank; `None` for `/register_worker` registrations.
    pub engine_id: Option<Arc<str>>,
    /// Its transfer address.
    pub addr: String,
}

/// One request id's mapping as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestRecord {
    /// The dp rank that holds the request's KV.
    pub dp_rank: Rank,
    /// When the mapping expires, in milliseconds since the Unix epoch.
    pub expires_at_ms: u64,
}

/// An atomic change to the worker table: everything in `remove` goes, then everything in `put` is
/// written. Backends apply it all or nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerChange {
    /// Slots to delete.
    pub remove: Vec<Slot>,
    /// Workers to write (insert or overwrite).
    pub put: Vec<WorkerRecord>,
}

impl WorkerChange {
    /// True when the change does nothing.
    pub fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.put.is_empty()
    }
}

/// Everything a store holds, read once at start-up.
#[derive(Debug, Default)]
pub struct StoredState {
    /// Every registered worker.
    pub workers: Vec<WorkerRecord>,
    /// Every request id mapping, expired ones included (the registry drops those).
    pub requests: Vec<(String, RequestRecord)>,
}

/// Durable storage of workers and request ids.
///
/// Worker changes must be durable when their future resolves (they survive `kill -9`); request-id
/// writes may be buffered until [`Store::flush`] (they are many, short-lived and re-creatable).
pub trait Store: Send + Sync + 'static {
    /// Reads everything stored.
    fn load(&self) -> StoreFuture<'_, StoredState>;
    /// Applies a worker change atomically and durably.
    fn commit_workers<'a>(&'a self, change: &'a WorkerChange) -> StoreFuture<'a, ()>;
    /// Records a request id mapping.
    fn put_request<'a>(&'a self, req_id: &'a str, record: RequestRecord) -> StoreFuture<'a, ()>;
    /// Forgets request id mappings (absent ones are ignored).
    fn remove_requests<'a>(&'a self, req_ids: &'a [Arc<str>]) -> StoreFuture<'a, ()>;
    /// Makes every buffered write durable.
    fn flush(&self) -> StoreFuture<'_, ()>;
}
