//! pd-bootstrap's own routes: leases (`POST /leases/{id}/keepalive`, `DELETE /leases/{id}`), the
//! worker list and its changes (`GET /workers`, `GET /watch`), deregistration (`DELETE
//! /register`), request release (`DELETE /requests/{id}`) and readiness (`GET /ready`).

use serde::{Deserialize, Serialize};

use crate::{LeaseId, Rank, Revision};

/// Answer of `POST /leases/{lease_id}/keepalive` (404 when the lease has expired).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseStatus {
    /// Always `"ok"`.
    pub status: String,
    /// The lease kept alive.
    pub lease_id: LeaseId,
    /// Seconds it now lives without another keepalive.
    pub lease_ttl: u32,
}

/// Answer of `DELETE /leases/{lease_id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokeResponse {
    /// Always `"ok"`: revoking is idempotent.
    pub status: String,
    /// Whether the lease was live before this call (its registrations are gone either way).
    pub revoked: bool,
}

/// One registered worker, as `GET /workers` and `GET /watch` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The engine that owns the worker's dp rank (absent for `/register_worker` registrations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_id: Option<String>,
    /// Data-parallel rank.
    pub dp_rank: Rank,
    /// Tensor-parallel rank.
    pub tp_rank: Rank,
    /// Pipeline-parallel rank.
    pub pp_rank: Rank,
    /// Its transfer address.
    pub addr: String,
    /// The lease it lives by, if it registered with one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<LeaseId>,
}

/// Answer of `GET /workers`: every registered worker as of `revision`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerList {
    /// The registry revision this list is current at; watch from here.
    pub revision: Revision,
    /// The workers, in (dp, tp, pp) order.
    pub workers: Vec<WorkerInfo>,
}

/// What happened to a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerEventKind {
    /// Registered, or registered again with other values.
    Put,
    /// Deregistered, replaced by another engine's registration, or its lease expired.
    Delete,
}

/// One change of the worker table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerEvent {
    /// The revision of the change (changes committed together share one).
    pub revision: Revision,
    /// Put or delete.
    #[serde(rename = "type")]
    pub kind: WorkerEventKind,
    /// The worker as registered (for a delete: as it was before).
    pub worker: WorkerInfo,
}

/// Answer of `GET /watch?since=REV`: the changes after `since`, or none when the wait ran out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchBatch {
    /// The registry revision the caller is now current at: pass it as the next `since`.
    pub revision: Revision,
    /// The changes, oldest first.
    pub events: Vec<WorkerEvent>,
}

/// Answer of `GET /watch` with status 410: `since` is older than the history kept; re-list with
/// `GET /workers` and watch from its revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchGone {
    /// What happened.
    pub detail: String,
    /// The registry's current revision.
    pub revision: Revision,
}

/// `DELETE /register`: remove one worker, one dp group or a whole engine.
///
/// Ranks left out widen the selection: only `engine_id` removes every worker of the engine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deregister {
    /// The engine whose registrations are removed.
    pub engine_id: String,
    /// Only this dp rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<Rank>,
    /// Only this tp rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_rank: Option<Rank>,
    /// Only this pp rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_rank: Option<Rank>,
}

/// Answer of `DELETE /register`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeregisterResponse {
    /// Always `"ok"`.
    pub status: String,
    /// How many worker slots were removed (0 is not an error: deregistration is idempotent).
    pub removed: usize,
}

/// Answer of `DELETE /requests/{req_id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseResponse {
    /// Always `"ok"`: releasing is idempotent.
    pub status: String,
    /// Whether the id was live before this call.
    pub released: bool,
}

/// Answer of `GET /ready` (200 when ready, 503 with `detail` when not).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadyStatus {
    /// `"ready"` or `"not_ready"`.
    pub status: String,
    /// Registered workers.
    pub registered: usize,
    /// Workers the configured topology expects (absent when none is configured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected: Option<usize>,
    /// Expected workers not yet registered.
    pub missing: usize,
    /// Why the topology is not ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}
