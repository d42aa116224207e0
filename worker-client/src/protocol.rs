//! Wire types of every bootstrap-server route, defined once and shared by the server, the client,
//! the proxy and the examples.
//!
//! The JSON shapes follow vLLM's Mooncake connector exactly (see `docs/protocol.md`); fields that
//! are ours (`replace`, the deregistration body) are optional so vLLM's clients never send them.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, SeqAccess, Visitor};
use serde::ser::SerializeTuple;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A data-, tensor- or pipeline-parallel rank.
pub type Rank = u32;

/// The largest rank any route accepts; anything above is rejected as absurd.
pub const MAX_RANK: Rank = 65_535;

/// The longest engine id or request id accepted, in bytes.
pub const MAX_ID_LEN: usize = 256;

/// The longest transfer address accepted, in bytes.
pub const MAX_ADDR_LEN: usize = 512;

/// The most request ids one `POST /query_requests` may ask about.
pub const MAX_QUERY_IDS: usize = 4096;

/// The longest lease a registration may ask for, in seconds (a day).
pub const MAX_LEASE_TTL: u32 = 86_400;

/// Identifies a lease: a registration that lives only while its worker keeps it alive.
pub type LeaseId = i64;

/// A position in the registry's history of worker changes (see `GET /watch`).
pub type Revision = u64;

/// `POST /register`: one P worker announces its ranks and transfer address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterWorker {
    /// The engine (one vLLM instance, all its ranks) the worker belongs to.
    pub engine_id: String,
    /// Data-parallel rank.
    pub dp_rank: Rank,
    /// Tensor-parallel rank.
    pub tp_rank: Rank,
    /// Pipeline-parallel rank.
    pub pp_rank: Rank,
    /// Where D pulls this worker's KV from, e.g. `tcp://10.0.0.5:41231`.
    pub addr: String,
    /// Ours: take the slot (and the dp rank) over from another engine, e.g. after a restart.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replace: bool,
    /// Ours: seconds the registration lives without a keepalive (a lease). Without it the
    /// registration stays until it is deregistered or replaced, as vLLM's clients expect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ttl: Option<u32>,
}

/// Answer of `POST /register`: `{"status": "ok"}`, plus the lease when one was asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterResponse {
    /// Always `"ok"`.
    pub status: String,
    /// The lease that keeps this registration alive (only with `lease_ttl`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<LeaseId>,
    /// Its time to live in seconds (only with `lease_ttl`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ttl: Option<u32>,
}

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

/// `POST /register_worker` (vLLM's request-keyed API): a worker without an engine id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterLegacyWorker {
    /// Data-parallel rank.
    pub dp_rank: Rank,
    /// Tensor-parallel rank.
    pub tp_rank: Rank,
    /// Where D pulls this worker's KV from.
    pub worker_addr: String,
}

/// `POST /register_request`: P tells which dp rank serves a request id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterRequest {
    /// The request (transfer) id.
    pub req_id: String,
    /// The dp rank of P that holds the request's KV.
    pub dp_rank: Rank,
}

/// `POST /query_requests`: D asks where the KV of a batch of request ids lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueryRequests {
    /// The request ids to resolve.
    pub req_ids: Vec<String>,
    /// The asking D worker's tp rank.
    pub tp_rank: Rank,
    /// The asking D deployment's tp size (must equal P's).
    pub tp_size: Rank,
}

/// Answer of `POST /query_requests`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueryRequestsResponse {
    /// One outcome per asked id.
    pub results: BTreeMap<String, RequestLocation>,
}

/// Where one request's KV lives, serialized as vLLM's two-element array:
/// `["ok", [addr, ...]]`, `["retry", []]` or `["<error text>", []]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestLocation {
    /// The addresses of the P workers that hold this D rank's share.
    Ok(Vec<String>),
    /// P has not registered the id yet; ask again later.
    Retry,
    /// The id is known but cannot be served; the text says why.
    Error(String),
}

impl Serialize for RequestLocation {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let empty: &[String] = &[];
        let (status, addrs) = match self {
            RequestLocation::Ok(addrs) => ("ok", addrs.as_slice()),
            RequestLocation::Retry => ("retry", empty),
            RequestLocation::Error(text) => (text.as_str(), empty),
        };
        let mut tuple = serializer.serialize_tuple(2)?;
        tuple.serialize_element(status)?;
        tuple.serialize_element(addrs)?;
        tuple.end()
    }
}

impl<'de> Deserialize<'de> for RequestLocation {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PairVisitor;
        impl<'de> Visitor<'de> for PairVisitor {
            type Value = RequestLocation;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a [status, [addresses]] pair")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let status: String = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let addrs: Vec<String> = seq
                    .next_element()?
                    .ok_or_else(|| de::Error::invalid_length(1, &self))?;
                Ok(match status.as_str() {
                    "ok" => RequestLocation::Ok(addrs),
                    "retry" => RequestLocation::Retry,
                    _ => RequestLocation::Error(status),
                })
            }
        }
        deserializer.deserialize_tuple(2, PairVisitor)
    }
}

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

/// The workers of one dp rank, as `GET /query` shows them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DpGroup {
    /// The engine that owns this dp rank (absent for workers registered through `/register_worker`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_id: Option<String>,
    /// tp rank -> pp rank -> transfer address.
    pub worker_addr: BTreeMap<Rank, BTreeMap<Rank, String>>,
}

/// The answer of `GET /query`: dp rank -> its group (JSON keys are decimal strings).
pub type Topology = BTreeMap<Rank, DpGroup>;

/// `kv_transfer_params` as the proxy sends it to P and D (and P may return it, in sequential mode).
///
/// Fields that are `None` are left out of the JSON; unknown fields P returns are kept in `extra`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// True on the request to P: compute KV for a remote decoder.
    #[serde(default)]
    pub do_remote_decode: bool,
    /// True on the request to D: pull KV from a remote prefiller.
    #[serde(default)]
    pub do_remote_prefill: bool,
    /// Where D asks which P worker holds the KV, e.g. `http://10.0.0.5:8998`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_bootstrap_addr: Option<String>,
    /// The engine id of the P dp rank that computed the KV.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    /// The id shared by P and D for this request's transfer (`xfer-<uuid4>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_id: Option<String>,
    /// Anything else (what other connectors put here), passed through untouched.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// Why an id or address was refused; the text names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct FieldError {
    /// The offending field.
    pub field: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

impl FieldError {
    fn new(field: &'static str, problem: impl Into<String>) -> Self {
        FieldError {
            field,
            problem: problem.into(),
        }
    }
}

/// Checks an engine id or request id: non-empty, at most [`MAX_ID_LEN`] bytes, no control characters.
pub fn validate_id(field: &'static str, value: &str) -> Result<(), FieldError> {
    if value.is_empty() {
        return Err(FieldError::new(field, "must not be empty"));
    }
    if value.len() > MAX_ID_LEN {
        return Err(FieldError::new(
            field,
            format!("is {} bytes long, the limit is {MAX_ID_LEN}", value.len()),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(FieldError::new(
            field,
            "must not contain control characters",
        ));
    }
    Ok(())
}

/// Checks a lease time to live: 1 to [`MAX_LEASE_TTL`] seconds.
pub fn validate_lease_ttl(field: &'static str, value: u32) -> Result<(), FieldError> {
    if value == 0 || value > MAX_LEASE_TTL {
        return Err(FieldError::new(
            field,
            format!("{value} is out of range (1 to {MAX_LEASE_TTL} seconds)"),
        ));
    }
    Ok(())
}

/// Checks a rank against [`MAX_RANK`].
pub fn validate_rank(field: &'static str, value: Rank) -> Result<(), FieldError> {
    if value > MAX_RANK {
        return Err(FieldError::new(
            field,
            format!("{value} is out of range (at most {MAX_RANK})"),
        ));
    }
    Ok(())
}

/// Checks a transfer address: `scheme://host:port[/path]` (e.g. `tcp://10.0.0.5:41231`) or
/// `host:port`, with a port in 1..=65535.
pub fn validate_addr(field: &'static str, value: &str) -> Result<(), FieldError> {
    if value.is_empty() {
        return Err(FieldError::new(field, "must not be empty"));
    }
    if value.len() > MAX_ADDR_LEN {
        return Err(FieldError::new(
            field,
            format!("is {} bytes long, the limit is {MAX_ADDR_LEN}", value.len()),
        ));
    }
    let unparsable = || {
        FieldError::new(
            field,
            format!("{value:?} is not an address of the form scheme://host:port or host:port"),
        )
    };
    let with_scheme;
    let url_text = if value.contains("://") {
        value
    } else {
        with_scheme = format!("tcp://{value}");
        &with_scheme
    };
    let url = url::Url::parse(url_text).map_err(|_| unparsable())?;
    match (url.host_str(), url.port()) {
        (Some(host), Some(port)) if !host.is_empty() && port != 0 => Ok(()),
        _ => Err(unparsable()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_location_round_trips_as_vllm_pairs() {
        let mut results = BTreeMap::new();
        results.insert(
            "a".to_owned(),
            RequestLocation::Ok(vec!["tcp://h:1".into()]),
        );
        results.insert("b".to_owned(), RequestLocation::Retry);
        results.insert("c".to_owned(), RequestLocation::Error("gone".into()));
        let body = QueryRequestsResponse { results };
        let json = serde_json::to_string(&body).unwrap();
        assert_eq!(
            json,
            r#"{"results":{"a":["ok",["tcp://h:1"]],"b":["retry",[]],"c":["gone",[]]}}"#
        );
        assert_eq!(
            serde_json::from_str::<QueryRequestsResponse>(&json).unwrap(),
            body
        );
    }

    #[test]
    fn topology_keys_are_decimal_strings() {
        let mut topology = Topology::new();
        topology.insert(
            10,
            DpGroup {
                engine_id: Some("e".into()),
                worker_addr: BTreeMap::from([(0, BTreeMap::from([(0, "tcp://h:1".into())]))]),
            },
        );
        let json = serde_json::to_string(&topology).unwrap();
        assert_eq!(
            json,
            r#"{"10":{"engine_id":"e","worker_addr":{"0":{"0":"tcp://h:1"}}}}"#
        );
        assert_eq!(serde_json::from_str::<Topology>(&json).unwrap(), topology);
    }

    #[test]
    fn addresses_are_checked() {
        assert!(validate_addr("addr", "tcp://10.0.0.5:41231").is_ok());
        assert!(validate_addr("addr", "tcp://[::1]:5000").is_ok());
        assert!(validate_addr("addr", "node-3:5000").is_ok());
        for bad in [
            "",
            "tcp://host",
            "nonsense",
            "tcp://:80",
            "host:0",
            "host:99999",
        ] {
            assert!(validate_addr("addr", bad).is_err(), "{bad:?} passed");
        }
    }

    #[test]
    fn ids_are_checked() {
        assert!(validate_id("engine_id", "e-1").is_ok());
        assert!(validate_id("engine_id", "").is_err());
        assert!(validate_id("engine_id", &"x".repeat(MAX_ID_LEN + 1)).is_err());
        assert!(validate_id("req_id", "a\nb").is_err());
    }

    #[test]
    fn kv_transfer_params_keep_unknown_fields() {
        let json =
            r#"{"do_remote_decode":false,"do_remote_prefill":true,"remote_block_ids":[1,2]}"#;
        let params: KvTransferParams = serde_json::from_str(json).unwrap();
        assert!(params.do_remote_prefill);
        assert_eq!(params.extra["remote_block_ids"], serde_json::json!([1, 2]));
        assert_eq!(serde_json::to_string(&params).unwrap(), json);
    }
}
