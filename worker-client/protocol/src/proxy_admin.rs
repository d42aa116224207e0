//! The front doors' operator routes (pd-proxy's, and pd-epp's on its metrics port):
//! `GET /admin/backends`, every backend it sends to, with its health, its drain marks and the
//! requests in flight through it, which `worker-client drain --wait-idle` reads to know when a
//! drained engine is idle; and `POST /admin/drain`'s body.

use serde::{Deserialize, Serialize};

use crate::Rank;

/// The answer of `GET /admin/backends`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backends {
    /// Every prefill.
    pub prefills: Vec<BackendState>,
    /// Every decode.
    pub decodes: Vec<BackendState>,
}

/// One backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendState {
    /// `prefill` or `decode`.
    pub role: String,
    /// Its URL.
    pub url: String,
    /// Passing its health checks.
    pub healthy: bool,
    /// Drained at this proxy (`POST /admin/drain`).
    pub drained: bool,
    /// Calls to it in flight through this proxy.
    pub in_flight: usize,
    /// No call in flight: safe to restart once it takes no new requests.
    pub idle: bool,
    /// It left this proxy's pool (its address left DNS) while calls to it were in flight: it
    /// takes no new request, and is listed until those calls end.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub leaving: bool,
    /// A prefill's dp ranks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dp_ranks: Vec<RankState>,
    /// The engine version its `GET /version` reports, once known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// One dp rank of a prefill.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankState {
    /// The dp rank.
    pub dp_rank: Rank,
    /// Its engine id (none without a bootstrap server, or on SGLang's).
    pub engine_id: Option<String>,
    /// Its engine is marked draining in the registry.
    pub draining: bool,
    /// P calls to it in flight through this proxy.
    pub in_flight: usize,
}

/// The body of `POST /admin/drain`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrainRequest {
    /// The backend's URL, as configured.
    pub url: String,
    /// Drain it (the default) or lift the mark.
    #[serde(default = "drain_by_default")]
    pub draining: bool,
}

fn drain_by_default() -> bool {
    true
}
