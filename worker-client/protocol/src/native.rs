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
    /// The same id as a string (see [`LeaseId`]).
    #[serde(default)]
    pub lease_id_str: String,
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
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    /// The same id as a string (see [`LeaseId`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id_str: Option<String>,
    /// The engine's incarnation: it grows whenever the engine's registration is taken over
    /// (a restart with the same or a new engine id, or new addresses), so a cached lookup of an
    /// older incarnation is stale. Absent from servers that do not know incarnations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incarnation: Option<u64>,
    /// An operator marked the engine draining: routers send it no new requests.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
    /// What the engine serves and how its KV is laid out, as it registered it.
    #[serde(flatten)]
    pub meta: EngineMeta,
}

/// What an engine serves and how its KV is laid out: what a D worker and the proxy check before
/// pairing it with another engine. Every field is optional; absent ones are not checked.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct EngineMeta {
    /// The served model's name (what `/v1/models` lists).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The KV cache's element type, e.g. `bfloat16` or `fp8_e4m3`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_dtype: Option<String>,
    /// Tokens per KV block (page).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// The engine's tensor-parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<Rank>,
    /// The engine's pipeline-parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_size: Option<Rank>,
    /// The version of the KV transfer protocol the engine speaks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol_version: Option<u32>,
}

impl EngineMeta {
    /// True when no field is set.
    pub fn is_empty(&self) -> bool {
        *self == EngineMeta::default()
    }

    /// The first field set on both sides with different values: `(field, ours, theirs)`.
    pub fn mismatch(&self, other: &EngineMeta) -> Option<(&'static str, String, String)> {
        fn differ<T: PartialEq + ToString>(
            field: &'static str,
            ours: &Option<T>,
            theirs: &Option<T>,
        ) -> Option<(&'static str, String, String)> {
            match (ours, theirs) {
                (Some(a), Some(b)) if a != b => Some((field, a.to_string(), b.to_string())),
                _ => None,
            }
        }
        differ("model", &self.model, &other.model)
            .or_else(|| {
                differ(
                    "kv_cache_dtype",
                    &self.kv_cache_dtype,
                    &other.kv_cache_dtype,
                )
            })
            .or_else(|| differ("block_size", &self.block_size, &other.block_size))
            .or_else(|| differ("tp_size", &self.tp_size, &other.tp_size))
            .or_else(|| differ("pp_size", &self.pp_size, &other.pp_size))
            .or_else(|| {
                differ(
                    "protocol_version",
                    &self.protocol_version,
                    &other.protocol_version,
                )
            })
    }
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

/// Answer of `POST /engines/{engine_id}/drain` and `DELETE /engines/{engine_id}/drain`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainResponse {
    /// `ok`.
    pub status: String,
    /// The engine.
    pub engine_id: String,
    /// Whether it is now marked draining.
    pub draining: bool,
    /// How many workers the engine has (all carry the mark).
    pub workers: usize,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_meta_is_flat_optional_and_compared_field_by_field() {
        let info: WorkerInfo = serde_json::from_str(
            r#"{"engine_id":"e","dp_rank":0,"tp_rank":1,"pp_rank":0,"addr":"tcp://h:1",
                "incarnation":7,"model":"m","block_size":16}"#,
        )
        .unwrap();
        assert_eq!(info.incarnation, Some(7));
        assert_eq!(info.meta.model.as_deref(), Some("m"));
        let old: WorkerInfo = serde_json::from_str(
            r#"{"engine_id":"e","dp_rank":0,"tp_rank":1,"pp_rank":0,"addr":"tcp://h:1"}"#,
        )
        .unwrap();
        assert!(old.meta.is_empty() && old.incarnation.is_none());
        let d = EngineMeta {
            model: Some("m".into()),
            block_size: Some(32),
            ..EngineMeta::default()
        };
        assert_eq!(
            d.mismatch(&info.meta),
            Some(("block_size", "32".into(), "16".into()))
        );
        assert_eq!(d.mismatch(&old.meta), None, "absent fields are not checked");
    }
}
