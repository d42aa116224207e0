//! The embedded default store: a sled database in `--data-dir`.
//!
//! Two trees: `workers` (key: dp, tp, pp as big-endian u32s; value: JSON) and `requests` (key: the
//! request id; value: dp rank and expiry as big-endian integers). Worker commits are flushed to
//! disk before they are acknowledged; request ids are flushed by sled every `flush_every_ms` and on
//! [`Store::flush`] (graceful shutdown).

use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{
    RequestRecord, Slot, Store, StoreError, StoreFuture, StoredState, WorkerChange, WorkerRecord,
};

/// How often sled writes buffered request ids to disk on its own.
const BACKGROUND_FLUSH_MS: u64 = 200;

/// Memory sled may use for its page cache.
const CACHE_BYTES: u64 = 64 * 1024 * 1024;

/// The sled-backed [`Store`].
pub struct SledStore {
    db: sled::Db,
    workers: sled::Tree,
    requests: sled::Tree,
}

#[derive(Serialize, Deserialize)]
struct StoredWorker {
    engine_id: Option<String>,
    addr: String,
}

fn backend(err: sled::Error) -> StoreError {
    StoreError::Backend(err.to_string())
}

fn slot_key(slot: Slot) -> [u8; 12] {
    let mut key = [0u8; 12];
    key[0..4].copy_from_slice(&slot.dp.to_be_bytes());
    key[4..8].copy_from_slice(&slot.tp.to_be_bytes());
    key[8..12].copy_from_slice(&slot.pp.to_be_bytes());
    key
}

fn decode_slot(key: &[u8]) -> Option<Slot> {
    let word = |i: usize| Some(u32::from_be_bytes(key.get(i..i + 4)?.try_into().ok()?));
    (key.len() == 12).then_some(())?;
    Some(Slot {
        dp: word(0)?,
        tp: word(4)?,
        pp: word(8)?,
    })
}

fn encode_request(record: RequestRecord) -> [u8; 12] {
    let mut value = [0u8; 12];
    value[0..4].copy_from_slice(&record.dp_rank.to_be_bytes());
    value[4..12].copy_from_slice(&record.expires_at_ms.to_be_bytes());
    value
}

fn decode_request(value: &[u8]) -> Option<RequestRecord> {
    (value.len() == 12).then_some(())?;
    Some(RequestRecord {
        dp_rank: u32::from_be_bytes(value[0..4].try_into().ok()?),
        expires_at_ms: u64::from_be_bytes(value[4..12].try_into().ok()?),
    })
}

fn corrupt(key: &[u8], reason: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        reason: reason.into(),
    }
}

impl SledStore {
    /// Opens (or creates) the database in `dir`.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let db = sled::Config::new()
            .path(dir)
            .cache_capacity(CACHE_BYTES)
            .flush_every_ms(Some(BACKGROUND_FLUSH_MS))
            .open()
            .map_err(backend)?;
        let workers = db.open_tree("workers").map_err(backend)?;
        let requests = db.open_tree("requests").map_err(backend)?;
        Ok(SledStore {
            db,
            workers,
            requests,
        })
    }

    fn load_sync(&self) -> Result<StoredState, StoreError> {
        let mut state = StoredState::default();
        for entry in self.workers.iter() {
            let (key, value) = entry.map_err(backend)?;
            let slot = decode_slot(&key).ok_or_else(|| corrupt(&key, "bad worker key"))?;
            let stored: StoredWorker =
                serde_json::from_slice(&value).map_err(|e| corrupt(&key, e.to_string()))?;
            state.workers.push(WorkerRecord {
                slot,
                engine_id: stored.engine_id.map(Arc::from),
                addr: stored.addr,
            });
        }
        for entry in self.requests.iter() {
            let (key, value) = entry.map_err(backend)?;
            let id = String::from_utf8(key.to_vec()).map_err(|_| corrupt(&key, "non-UTF-8 id"))?;
            let record =
                decode_request(&value).ok_or_else(|| corrupt(&key, "bad request value"))?;
            state.requests.push((id, record));
        }
        Ok(state)
    }

    fn worker_batch(change: &WorkerChange) -> Result<sled::Batch, StoreError> {
        let mut batch = sled::Batch::default();
        for slot in &change.remove {
            batch.remove(&slot_key(*slot));
        }
        for worker in &change.put {
            let value = serde_json::to_vec(&StoredWorker {
                engine_id: worker.engine_id.as_deref().map(str::to_owned),
                addr: worker.addr.clone(),
            })
            .map_err(|e| StoreError::Backend(e.to_string()))?;
            batch.insert(&slot_key(worker.slot), value);
        }
        Ok(batch)
    }
}

impl Store for SledStore {
    fn load(&self) -> StoreFuture<'_, StoredState> {
        Box::pin(async move { self.load_sync() })
    }

    fn commit_workers<'a>(&'a self, change: &'a WorkerChange) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.workers
                .apply_batch(Self::worker_batch(change)?)
                .map_err(backend)?;
            self.workers.flush_async().await.map_err(backend)?;
            Ok(())
        })
    }

    fn put_request<'a>(&'a self, req_id: &'a str, record: RequestRecord) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            self.requests
                .insert(req_id.as_bytes(), &encode_request(record))
                .map_err(backend)?;
            Ok(())
        })
    }

    fn remove_requests<'a>(&'a self, req_ids: &'a [Arc<str>]) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let mut batch = sled::Batch::default();
            for id in req_ids {
                batch.remove(id.as_bytes());
            }
            self.requests.apply_batch(batch).map_err(backend)
        })
    }

    fn flush(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.db.flush_async().await.map_err(backend)?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_values_round_trip() {
        let slot = Slot {
            dp: 3,
            tp: 65_535,
            pp: 1,
        };
        assert_eq!(decode_slot(&slot_key(slot)), Some(slot));
        assert_eq!(decode_slot(&[1, 2, 3]), None);
        let record = RequestRecord {
            dp_rank: 7,
            expires_at_ms: 1_700_000_000_123,
        };
        assert_eq!(decode_request(&encode_request(record)), Some(record));
        assert_eq!(decode_request(b"short"), None);
    }

    #[tokio::test]
    async fn state_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let worker = WorkerRecord {
            slot: Slot {
                dp: 1,
                tp: 0,
                pp: 0,
            },
            engine_id: Some(Arc::from("e1")),
            addr: "tcp://127.0.0.1:9".into(),
        };
        let record = RequestRecord {
            dp_rank: 1,
            expires_at_ms: 42,
        };
        {
            let store = SledStore::open(dir.path()).unwrap();
            let change = WorkerChange {
                remove: vec![],
                put: vec![worker.clone()],
            };
            store.commit_workers(&change).await.unwrap();
            store.put_request("r1", record).await.unwrap();
            store.put_request("r2", record).await.unwrap();
            store.remove_requests(&[Arc::from("r2")]).await.unwrap();
            store.flush().await.unwrap();
        }
        let store = SledStore::open(dir.path()).unwrap();
        let state = store.load().await.unwrap();
        assert_eq!(state.workers, vec![worker]);
        assert_eq!(state.requests, vec![("r1".to_owned(), record)]);
    }
}
