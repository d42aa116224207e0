//! The registry's domain model: worker slots, registrations, leases, request-id records and
//! atomic changes to the worker table. No HTTP and no dialect here: the wire modules under
//! [`crate::http`] map their JSON to and from these types, and the stores persist them.

use std::sync::Arc;

use pd_protocol::native::EngineMeta;
use pd_protocol::{LeaseId, Rank, Revision};

/// The (dp, cp, tp, pp) position of one worker. The context-parallel rank is SGLang's; vLLM's
/// workers are all at cp 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot {
    /// Data-parallel rank.
    pub dp: Rank,
    /// Context-parallel rank (0 for vLLM).
    pub cp: Rank,
    /// Tensor-parallel rank.
    pub tp: Rank,
    /// Pipeline-parallel rank.
    pub pp: Rank,
}

impl std::fmt::Display for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.cp == 0 {
            write!(
                f,
                "dp_rank={}, tp_rank={}, pp_rank={}",
                self.dp, self.tp, self.pp
            )
        } else {
            write!(
                f,
                "dp_rank={}, cp_rank={}, tp_rank={}, pp_rank={}",
                self.dp, self.cp, self.tp, self.pp
            )
        }
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
    /// The lease it lives by; `None` lives until deregistered or replaced.
    pub lease: Option<Lease>,
    /// Its engine's incarnation when it registered (0: stored before incarnations existed).
    pub incarnation: u64,
    /// What its engine serves and how its KV is laid out, as registered.
    pub meta: Arc<EngineMeta>,
    /// Attributes a wire dialect keeps with the worker and reads back (SGLang's topology row);
    /// the registry stores them without reading them.
    pub extra: Arc<Extra>,
    /// An operator marked its engine draining: routers send it no new requests.
    pub draining: bool,
}

/// A wire dialect's own attributes of a worker, stored as JSON.
pub type Extra = serde_json::Map<String, serde_json::Value>;

/// A granted lease: its id and time to live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The lease id.
    pub id: LeaseId,
    /// Seconds it lives without a keepalive.
    pub ttl: u32,
}

/// What a bootstrap room's id starts with in the request-id space: a control character no
/// request id may hold, so rooms and request ids never mix.
pub const ROOM_PREFIX: &str = "\u{1f}room/";

/// The id a bootstrap room (SGLang) is kept under.
pub fn room_id(room: u64) -> String {
    format!("{ROOM_PREFIX}{room}")
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

    /// How many slots the change touches.
    pub fn len(&self) -> usize {
        self.remove.len() + self.put.len()
    }

    /// This change followed by `next`, as one change: what applying both in order does.
    pub fn then(mut self, next: WorkerChange) -> WorkerChange {
        for slot in next.remove {
            self.put.retain(|w| w.slot != slot);
            if !self.remove.contains(&slot) {
                self.remove.push(slot);
            }
        }
        for worker in next.put {
            self.put.retain(|w| w.slot != worker.slot);
            self.put.push(worker);
        }
        self
    }
}

/// A worker announcing itself under an engine id (vLLM's `POST /register`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The engine that owns the worker's dp rank.
    pub engine_id: String,
    /// Its position.
    pub slot: Slot,
    /// Its transfer address.
    pub addr: String,
    /// Take the slot over from the engine holding it (`Some(true)`), never do
    /// (`Some(false)`), or as the server's policy says (`None`).
    pub replace: Option<bool>,
    /// Seconds the registration lives without a keepalive; `None` lives until removed.
    pub lease_ttl: Option<u32>,
    /// What the engine serves and how its KV is laid out.
    pub meta: EngineMeta,
    /// A wire dialect's own attributes of the worker (see [`WorkerRecord::extra`]).
    pub extra: Extra,
}

/// Which of an engine's workers to remove: ranks left out widen the selection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deregistration {
    /// The engine.
    pub engine_id: String,
    /// Only this dp rank.
    pub dp: Option<Rank>,
    /// Only this tp rank.
    pub tp: Option<Rank>,
    /// Only this pp rank.
    pub pp: Option<Rank>,
}

/// What happened to a worker in one change of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// Registered, or registered again with other values.
    Put,
    /// Removed: deregistered, replaced by another engine's registration, or its lease expired.
    Delete,
}

/// One change of the worker table, as the watch reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The revision of the change (changes committed together share one).
    pub revision: Revision,
    /// Put or delete.
    pub kind: ChangeKind,
    /// The worker as registered (for a delete: as it was before).
    pub worker: WorkerRecord,
}

/// Where the KV of one request id lives, for one D tp rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// The addresses (in pp order) of the P workers that hold this D rank's share.
    Ready(Vec<String>),
    /// P has not registered the id yet (or it expired): ask again later.
    Pending,
    /// The id maps to a dp rank that has no workers.
    MissingDpGroup(Rank),
    /// The id's dp rank has no worker with the asked tp rank.
    MissingTpRank {
        /// The id's dp rank.
        dp: Rank,
        /// The tp rank asked for.
        tp: Rank,
    },
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

impl Readiness {
    /// True when a configured topology still misses workers.
    pub fn is_incomplete(&self) -> bool {
        self.expected.is_some() && self.missing > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(dp: Rank, addr: &str) -> WorkerRecord {
        WorkerRecord {
            slot: Slot {
                dp,
                cp: 0,
                tp: 0,
                pp: 0,
            },
            engine_id: Some(Arc::from("e")),
            addr: addr.to_owned(),
            lease: None,
            incarnation: 1,
            meta: Arc::default(),
            extra: Arc::default(),
            draining: false,
        }
    }

    #[test]
    fn changes_compose_like_applying_them_in_order() {
        let (a, b, c) = (worker(0, "a"), worker(1, "b"), worker(2, "c"));
        let first = WorkerChange {
            remove: vec![c.slot],
            put: vec![a.clone(), b.clone()],
        };
        let second = WorkerChange {
            remove: vec![a.slot, c.slot],
            put: vec![worker(1, "b2")],
        };
        let merged = first.then(second);
        // a was written then removed, b overwritten, c removed once.
        assert_eq!(merged.remove, vec![c.slot, a.slot]);
        assert_eq!(merged.put, vec![worker(1, "b2")]);
        assert_eq!(merged.len(), 3);
        let put_again = merged.then(WorkerChange {
            remove: Vec::new(),
            put: vec![a.clone()],
        });
        assert_eq!(put_again.put, vec![worker(1, "b2"), a]);
    }
}
