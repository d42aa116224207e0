//! The wire types of pd-bootstrap, one module per dialect, shared by the bootstrap server, the
//! worker client, the proxy and the examples. Only serde (and rmp for msgpack): no HTTP, no
//! runtime.
//!
//! - [`vllm`]: vLLM's Mooncake connector wire (`POST /register`, `GET /query`, the request-keyed
//!   routes and `kv_transfer_params`), with the optional fields that are ours.
//! - [`sglang`]: SGLang's bootstrap wire (`PUT`/`GET /route`, the bootstrap-room routes) and
//!   the fields its router adds to P's and D's bodies.
//! - [`native`]: pd-bootstrap's own routes (leases, `GET /workers`, `GET /watch`,
//!   deregistration, readiness).
//! - [`proxy_admin`]: pd-proxy's `GET /admin/backends` (what `worker-client drain --wait-idle`
//!   reads).
//! - [`kv_events`]: the KV cache events vLLM and SGLang publish over ZMQ (msgpack), both of
//!   vLLM's encodings.
//!
//! What every dialect shares (ranks, revisions, leases, the error body and the limits the server
//! enforces) is defined here.

use serde::{Deserialize, Serialize};

pub mod kv_events;
pub mod native;
pub mod proxy_admin;
pub mod sglang;
pub mod vllm;

/// A data-, tensor- or pipeline-parallel rank.
pub type Rank = u32;

/// The largest rank any route accepts; anything above is rejected as absurd.
pub const MAX_RANK: Rank = 65_535;

/// The longest engine id or request id accepted, in bytes.
pub const MAX_ID_LEN: usize = 256;

/// The longest transfer address accepted, in bytes.
pub const MAX_ADDR_LEN: usize = 512;

/// The longest lease a registration may ask for, in seconds (a day).
pub const MAX_LEASE_TTL: u32 = 86_400;

/// Identifies a lease: a registration that lives only while its worker keeps it alive.
///
/// Ids are 63-bit numbers (etcd's, or drawn at random), over 2^53: a JSON parser that reads
/// numbers as doubles (JavaScript's, and many others) loses their last digits. So every answer
/// that carries one as `lease_id` carries it again as the string `lease_id_str`, which such
/// clients read instead; the paths (`/leases/{lease_id}`) take the digits.
pub type LeaseId = i64;

/// A position in the registry's history of worker changes (see `GET /watch`).
pub type Revision = u64;

/// The answer to `{"status": "ok"}`-style routes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// `"ok"` (or `"ready"` for `/ready`).
    pub status: String,
}

impl Status {
    /// The usual `{"status": "ok"}`.
    pub fn ok() -> Self {
        Status {
            status: "ok".to_owned(),
        }
    }
}

/// Every error body: vLLM's (FastAPI's) `{"detail": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, naming the field or the conflict.
    pub detail: String,
}
