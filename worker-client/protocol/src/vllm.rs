//! vLLM's Mooncake connector wire: what its P workers send to `POST /register`, what its D
//! workers read from `GET /query`, the request-keyed routes of the connector's design
//! (`/register_worker`, `/register_request`, `/query_requests`) and the `kv_transfer_params` the
//! proxy puts in P's and D's bodies.
//!
//! The JSON shapes follow vLLM exactly (see `docs/protocol.md`); fields that are ours (`replace`,
//! `lease_ttl`, the lease in the answer) are optional, so vLLM's clients never send or miss them.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, SeqAccess, Visitor};
use serde::ser::SerializeTuple;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::native::EngineMeta;
use crate::{LeaseId, Rank};

/// The most request ids one `POST /query_requests` may ask about.
pub const MAX_QUERY_IDS: usize = 4096;

/// `POST /register`: one P worker announces its ranks and transfer address.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    /// Ours: `true` takes the slot over from the engine holding it (another engine, or this
    /// one at another address: a restart), `false` never does, absent follows the server's
    /// `--engine-conflict` policy (takeover by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replace: Option<bool>,
    /// Ours: seconds the registration lives without a keepalive (a lease). Without it the
    /// registration stays until it is deregistered or replaced, as vLLM's clients expect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ttl: Option<u32>,
    /// Ours: what the engine serves and how its KV is laid out, so that D and the proxy never
    /// pair it with an engine it cannot work with. Every field is optional.
    #[serde(flatten)]
    pub meta: EngineMeta,
}

/// Answer of `POST /register`: `{"status": "ok"}`, plus the lease when one was asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterResponse {
    /// Always `"ok"`.
    pub status: String,
    /// The lease that keeps this registration alive (only with `lease_ttl`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<LeaseId>,
    /// The same id as a string (see [`LeaseId`]; only with `lease_ttl`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id_str: Option<String>,
    /// Its time to live in seconds (only with `lease_ttl`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ttl: Option<u32>,
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
    fn kv_transfer_params_keep_unknown_fields() {
        let json =
            r#"{"do_remote_decode":false,"do_remote_prefill":true,"remote_block_ids":[1,2]}"#;
        let params: KvTransferParams = serde_json::from_str(json).unwrap();
        assert!(params.do_remote_prefill);
        assert_eq!(params.extra["remote_block_ids"], serde_json::json!([1, 2]));
        assert_eq!(serde_json::to_string(&params).unwrap(), json);
    }
}
