//! How stored values are encoded, the same in every backend: a worker as JSON, a request id's
//! mapping as 12 big-endian bytes (dp rank, expiry in Unix milliseconds).

use std::sync::Arc;

use pd_protocol::native::EngineMeta;
use pd_protocol::{LeaseId, Revision};
use serde::{Deserialize, Serialize};

use super::StoreError;
use crate::registry::model::{Extra, Lease, RequestRecord, Slot, WorkerRecord};

#[derive(Serialize, Deserialize)]
struct StoredWorker {
    engine_id: Option<String>,
    addr: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lease_id: Option<LeaseId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lease_ttl: Option<u32>,
    /// Absent in records written before incarnations existed: 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    incarnation: u64,
    #[serde(flatten)]
    meta: EngineMeta,
    /// A wire dialect's own attributes (SGLang's topology row).
    #[serde(default, skip_serializing_if = "Extra::is_empty")]
    extra: Extra,
    /// Marked draining by an operator (absent: not).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    draining: bool,
    /// The revision of the change that wrote the record, where the store needs it (the
    /// embedded store writes a one-worker change as this one record; absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    written_at: Revision,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// A decoding failure of the record at `key`.
pub(super) fn corrupt(key: &[u8], reason: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        reason: reason.into(),
    }
}

/// The stored value of a worker (its slot is in the key), written by the change at
/// `written_at` (0 where the store keeps revisions elsewhere).
pub(super) fn encode_worker(worker: &WorkerRecord, written_at: Revision) -> Vec<u8> {
    let stored = StoredWorker {
        engine_id: worker.engine_id.as_deref().map(str::to_owned),
        addr: worker.addr.clone(),
        lease_id: worker.lease.map(|l| l.id),
        lease_ttl: worker.lease.map(|l| l.ttl),
        incarnation: worker.incarnation,
        meta: (*worker.meta).clone(),
        extra: (*worker.extra).clone(),
        draining: worker.draining,
        written_at,
    };
    // Strings and integers always serialize.
    serde_json::to_vec(&stored).expect("a worker record serializes")
}

/// Decodes the worker stored at `key` for `slot`, and the revision that wrote it.
pub(super) fn decode_worker(
    slot: Slot,
    key: &[u8],
    value: &[u8],
) -> Result<(WorkerRecord, Revision), StoreError> {
    let stored: StoredWorker =
        serde_json::from_slice(value).map_err(|e| corrupt(key, e.to_string()))?;
    let lease = match (stored.lease_id, stored.lease_ttl) {
        (Some(id), Some(ttl)) => Some(Lease { id, ttl }),
        _ => None,
    };
    let worker = WorkerRecord {
        slot,
        engine_id: stored.engine_id.map(Arc::from),
        addr: stored.addr,
        lease,
        incarnation: stored.incarnation,
        meta: Arc::new(stored.meta),
        extra: Arc::new(stored.extra),
        draining: stored.draining,
    };
    Ok((worker, stored.written_at))
}

/// The stored value of a request id's mapping.
pub(super) fn encode_request(record: RequestRecord) -> [u8; 12] {
    let mut value = [0u8; 12];
    value[0..4].copy_from_slice(&record.dp_rank.to_be_bytes());
    value[4..12].copy_from_slice(&record.expires_at_ms.to_be_bytes());
    value
}

/// Decodes a request id's mapping.
pub(super) fn decode_request(value: &[u8]) -> Option<RequestRecord> {
    (value.len() == 12).then_some(())?;
    Some(RequestRecord {
        dp_rank: u32::from_be_bytes(value[0..4].try_into().ok()?),
        expires_at_ms: u64::from_be_bytes(value[4..12].try_into().ok()?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip() {
        let record = RequestRecord {
            dp_rank: 7,
            expires_at_ms: 1_700_000_000_123,
        };
        assert_eq!(decode_request(&encode_request(record)), Some(record));
        assert_eq!(decode_request(b"short"), None);
        let slot = Slot {
            dp: 1,
            cp: 0,
            tp: 2,
            pp: 3,
        };
        for lease in [None, Some(Lease { id: 99, ttl: 5 })] {
            let worker = WorkerRecord {
                slot,
                engine_id: Some(Arc::from("e")),
                addr: "tcp://h:1".into(),
                lease,
                incarnation: 3,
                meta: Arc::new(EngineMeta {
                    model: Some("m".into()),
                    ..EngineMeta::default()
                }),
                extra: Default::default(),
                draining: false,
            };
            for written_at in [0, 42] {
                assert_eq!(
                    decode_worker(slot, b"k", &encode_worker(&worker, written_at)).unwrap(),
                    (worker.clone(), written_at)
                );
            }
        }
        assert!(matches!(
            decode_worker(slot, b"k", b"{"),
            Err(StoreError::Corrupt { .. })
        ));
        // Records written before incarnations and metadata existed still load.
        let (old, written_at) =
            decode_worker(slot, b"k", br#"{"engine_id":"e","addr":"tcp://h:1"}"#).unwrap();
        assert_eq!(
            (old.incarnation, old.meta.is_empty(), written_at),
            (0, true, 0)
        );
    }
}
