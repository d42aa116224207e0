//! Why the registry refused a call, in its own words. Each wire module under [`crate::http`]
//! picks the status code and, where its clients expect particular wording (vLLM's), the text.

use pd_protocol::{LeaseId, Rank, Revision};

use super::plan::WorkerConflict;
use super::request_table::RequestConflict;
use super::validate::FieldError;
use crate::store::StoreError;

/// Why the registry refused a call.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A field is malformed.
    #[error(transparent)]
    Invalid(#[from] FieldError),
    /// A rank is not below the configured size of its kind.
    #[error("{kind} rank {rank} is out of range: the configured {kind} size is {size}")]
    OutOfRange {
        /// `DP`, `TP` or `PP`.
        kind: &'static str,
        /// The rank given.
        rank: Rank,
        /// The configured size.
        size: Rank,
    },
    /// A registration conflicts with what is on record.
    #[error(transparent)]
    Worker(#[from] WorkerConflict),
    /// A request id conflicts, or the table is full.
    #[error(transparent)]
    Request(#[from] RequestConflict),
    /// D's tp size differs from P's.
    #[error("D's tp size {got} differs from P's {expected}")]
    TpSizeMismatch {
        /// P's tp size.
        expected: Rank,
        /// The tp size D sent.
        got: Rank,
    },
    /// No worker of the engine is registered.
    #[error("engine {0:?} has no registered workers")]
    UnknownEngine(String),
    /// The lease has expired, was revoked or never existed.
    #[error("lease {0} is not live (expired or revoked): register again")]
    UnknownLease(LeaseId),
    /// A watcher asked for changes older than the history kept.
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
    /// waiting: it was restored from an older state, or the watcher knows another registry.
    #[error("revision {since} is newer than this registry's {revision} (restored, or another registry): re-list with GET /workers and watch from its revision")]
    AheadOfRegistry {
        /// What the watcher asked for.
        since: Revision,
        /// The current revision.
        revision: Revision,
    },
    /// The store failed (retrying may help).
    #[error(transparent)]
    Store(#[from] StoreError),
}
