//! The request-id table: which dp rank holds each live request's KV, with expiry.
//!
//! Every id lives for the same TTL, so insertion order is expiry order: a FIFO queue of
//! `(expires_at, id)` makes pruning O(1) per id without scanning the map. Released or
//! re-registered ids leave a stale queue entry behind, recognised on pop by its expiry.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use pd_protocol::Rank;

use crate::registry::model::{RequestRecord, ROOM_PREFIX};

/// Why a request id could not be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestConflict {
    /// The id is live with another dp rank.
    #[error("request id {req_id:?} maps to dp rank {registered}, not {requested}")]
    RankMismatch {
        /// The id.
        req_id: String,
        /// The rank on record.
        registered: Rank,
        /// The rank asked for.
        requested: Rank,
    },
    /// The table holds its maximum number of live ids.
    #[error("the request map is full ({capacity} live request ids); release ids after transfer or raise --max-requests")]
    Full {
        /// The configured maximum.
        capacity: usize,
    },
}

/// What an insertion did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    /// A new mapping.
    New,
    /// The same mapping was already live (a client retry); nothing changed.
    Replayed,
}

/// Live request ids, bounded in number.
#[derive(Debug)]
pub struct RequestTable {
    live: HashMap<Arc<str>, RequestRecord>,
    expiry: VecDeque<(u64, Arc<str>)>,
    capacity: usize,
}

impl RequestTable {
    /// An empty table holding at most `capacity` live ids.
    pub fn new(capacity: usize) -> Self {
        RequestTable {
            live: HashMap::new(),
            expiry: VecDeque::new(),
            capacity,
        }
    }

    /// Fills the table from stored records, dropping those expired at `now_ms`; returns the
    /// expired ids so the caller can delete them from the store.
    pub fn load(
        &mut self,
        mut records: Vec<(String, RequestRecord)>,
        now_ms: u64,
    ) -> Vec<Arc<str>> {
        records.sort_by_key(|(_, r)| r.expires_at_ms);
        let mut expired = Vec::new();
        for (id, record) in records {
            let id: Arc<str> = Arc::from(id);
            if record.expires_at_ms <= now_ms {
                expired.push(id);
            } else {
                self.expiry.push_back((record.expires_at_ms, id.clone()));
                self.live.insert(id, record);
            }
        }
        expired
    }

    /// How many ids are live (expired ones not yet pruned included).
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// True when no id is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// The dp rank of a live, unexpired id.
    pub fn get(&self, req_id: &str, now_ms: u64) -> Option<Rank> {
        self.live
            .get(req_id)
            .filter(|r| r.expires_at_ms > now_ms)
            .map(|r| r.dp_rank)
    }

    /// Records `req_id -> dp_rank` until `expires_at_ms`. An identical live mapping is a replay;
    /// an expired one is overwritten.
    pub fn insert(
        &mut self,
        req_id: &str,
        dp_rank: Rank,
        now_ms: u64,
        expires_at_ms: u64,
    ) -> Result<Inserted, RequestConflict> {
        if let Some(existing) = self.live.get(req_id) {
            if existing.expires_at_ms > now_ms {
                return if existing.dp_rank == dp_rank {
                    Ok(Inserted::Replayed)
                } else {
                    Err(RequestConflict::RankMismatch {
                        req_id: req_id.to_owned(),
                        registered: existing.dp_rank,
                        requested: dp_rank,
                    })
                };
            }
        } else if self.live.len() >= self.capacity {
            return Err(RequestConflict::Full {
                capacity: self.capacity,
            });
        }
        let id: Arc<str> = Arc::from(req_id);
        let record = RequestRecord {
            dp_rank,
            expires_at_ms,
        };
        self.expiry.push_back((expires_at_ms, id.clone()));
        self.live.insert(id, record);
        Ok(Inserted::New)
    }

    /// Forgets an id; true when it was live.
    pub fn remove(&mut self, req_id: &str) -> bool {
        let removed = self.live.remove(req_id).is_some();
        self.compact_if_stale();
        removed
    }

    /// Drops queue entries of released ids once they outnumber the live ones, so that a P
    /// that releases every id after its transfer keeps memory bounded by the live ids.
    fn compact_if_stale(&mut self) {
        if self.expiry.len() <= 2 * self.live.len() + 1024 {
            return;
        }
        let live = &self.live;
        self.expiry.retain(|(expires_at, id)| {
            live.get(id).is_some_and(|r| r.expires_at_ms == *expires_at)
        });
        self.expiry.shrink_to(self.expiry.len() * 2);
    }

    #[cfg(test)]
    fn queued(&self) -> usize {
        self.expiry.len()
    }

    /// Forgets `req_id` only if it still maps to exactly `record` (undoing a failed insert
    /// without clobbering a newer one).
    pub fn remove_if(&mut self, req_id: &str, record: RequestRecord) {
        if self.live.get(req_id) == Some(&record) {
            self.live.remove(req_id);
        }
    }

    /// Removes up to `max` ids that expired at `now_ms` and returns them.
    pub fn pop_expired(&mut self, now_ms: u64, max: usize) -> Vec<Arc<str>> {
        let mut pruned = Vec::new();
        while pruned.len() < max {
            match self.expiry.front() {
                Some((expires_at, _)) if *expires_at <= now_ms => {}
                _ => break,
            }
            let Some((expires_at, id)) = self.expiry.pop_front() else {
                break;
            };
            if let Entry::Occupied(entry) = self.live.entry(id) {
                if entry.get().expires_at_ms == expires_at {
                    pruned.push(entry.remove_entry().0);
                }
            }
        }
        if self.expiry.capacity() > 64 && self.expiry.len() < self.expiry.capacity() / 4 {
            self.expiry.shrink_to(self.expiry.len() * 2);
        }
        pruned
    }
}

/// Every id the registry maps to a dp rank: vLLM's request ids and SGLang's bootstrap rooms
/// (stored as ids that start with [`ROOM_PREFIX`]). Each kind lives as long as its own ttl, so
/// each keeps its own expiry queue; the capacity is shared.
#[derive(Debug)]
pub struct IdTables {
    requests: RequestTable,
    rooms: RequestTable,
}

impl IdTables {
    /// Empty tables holding at most `capacity` live ids of each kind.
    pub fn new(capacity: usize) -> Self {
        IdTables {
            requests: RequestTable::new(capacity),
            rooms: RequestTable::new(capacity),
        }
    }

    /// The table `id` belongs to.
    pub fn of(&mut self, id: &str) -> &mut RequestTable {
        if id.starts_with(ROOM_PREFIX) {
            &mut self.rooms
        } else {
            &mut self.requests
        }
    }

    /// The dp rank of a live, unexpired id of either kind.
    pub fn get(&self, id: &str, now_ms: u64) -> Option<Rank> {
        match id.starts_with(ROOM_PREFIX) {
            true => self.rooms.get(id, now_ms),
            false => self.requests.get(id, now_ms),
        }
    }

    /// Fills the tables from stored records; returns the ids that had expired.
    pub fn load(&mut self, records: Vec<(String, RequestRecord)>, now_ms: u64) -> Vec<Arc<str>> {
        let (rooms, requests): (Vec<_>, Vec<_>) = records
            .into_iter()
            .partition(|(id, _)| id.starts_with(ROOM_PREFIX));
        let mut expired = self.requests.load(requests, now_ms);
        expired.extend(self.rooms.load(rooms, now_ms));
        expired
    }

    /// Live ids of both kinds.
    pub fn len(&self) -> usize {
        self.requests.len() + self.rooms.len()
    }

    /// True when no id of either kind is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes up to `max` expired ids of both kinds and returns them.
    pub fn pop_expired(&mut self, now_ms: u64, max: usize) -> Vec<Arc<str>> {
        let mut expired = self.requests.pop_expired(now_ms, max);
        let left = max - expired.len();
        expired.extend(self.rooms.pop_expired(now_ms, left));
        expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_conflict_and_capacity() {
        let mut table = RequestTable::new(2);
        assert_eq!(table.insert("a", 1, 0, 100), Ok(Inserted::New));
        assert_eq!(table.insert("a", 1, 0, 100), Ok(Inserted::Replayed));
        assert_eq!(
            table.insert("a", 2, 0, 100),
            Err(RequestConflict::RankMismatch {
                req_id: "a".into(),
                registered: 1,
                requested: 2
            })
        );
        assert_eq!(table.insert("b", 0, 0, 100), Ok(Inserted::New));
        assert!(matches!(
            table.insert("c", 0, 0, 100),
            Err(RequestConflict::Full { capacity: 2 })
        ));
        assert!(table.remove("b"));
        assert_eq!(table.insert("c", 0, 0, 100), Ok(Inserted::New));
    }

    #[test]
    fn expiry_is_fifo_and_skips_stale_entries() {
        let mut table = RequestTable::new(10);
        table.insert("a", 0, 0, 10).unwrap();
        table.insert("b", 0, 0, 20).unwrap();
        table.insert("c", 0, 0, 30).unwrap();
        table.remove("b");
        assert_eq!(table.get("a", 9), Some(0));
        assert_eq!(table.get("a", 10), None, "expired ids read as absent");
        // "a" expired and is registered again with a later expiry: the old queue entry is stale.
        table.insert("a", 3, 15, 40).unwrap();
        let pruned = table.pop_expired(30, 100);
        assert_eq!(pruned, vec![Arc::from("c")]);
        assert_eq!(table.get("a", 31), Some(3));
        assert_eq!(table.pop_expired(40, 100), vec![Arc::from("a")]);
        assert!(table.is_empty());
    }

    #[test]
    fn released_ids_do_not_pile_up_in_the_expiry_queue() {
        let mut table = RequestTable::new(100);
        for i in 0..10_000 {
            let id = format!("r{i}");
            table.insert(&id, 0, 0, 1_000).unwrap();
            assert!(table.remove(&id));
        }
        assert!(table.is_empty());
        assert!(
            table.queued() <= 1025,
            "{} stale entries kept",
            table.queued()
        );
        table.insert("kept", 1, 0, 1_000).unwrap();
        assert_eq!(table.pop_expired(1_000, 10_000), vec![Arc::from("kept")]);
    }

    #[test]
    fn pruning_is_bounded_per_call() {
        let mut table = RequestTable::new(100);
        for i in 0..10 {
            table.insert(&format!("r{i}"), 0, 0, 5).unwrap();
        }
        assert_eq!(table.pop_expired(5, 4).len(), 4);
        assert_eq!(table.len(), 6);
    }

    #[test]
    fn load_drops_expired_and_orders_by_expiry() {
        let mut table = RequestTable::new(10);
        let record = |dp_rank, expires_at_ms| RequestRecord {
            dp_rank,
            expires_at_ms,
        };
        let expired = table.load(
            vec![
                ("late".into(), record(0, 50)),
                ("old".into(), record(0, 5)),
                ("early".into(), record(1, 20)),
            ],
            10,
        );
        assert_eq!(expired, vec![Arc::from("old")]);
        assert_eq!(table.pop_expired(20, 10), vec![Arc::from("early")]);
        assert_eq!(table.get("late", 20), Some(0));
    }
}
