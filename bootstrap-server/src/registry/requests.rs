//! Request ids: which dp rank holds each request's KV (vLLM's request-keyed routes), with
//! expiry, and where D's tp rank finds its share.

use std::sync::Arc;

use pd_protocol::Rank;

use super::model::{room_id, Location, RequestRecord};
use super::validate::{validate_id, validate_rank};
use super::{Inserted, Registry, RegistryError};
use crate::sync::{lock, now_ms};

/// How many expired ids one pruning step removes before it lets others take the lock.
const PRUNE_BATCH: usize = 4096;

impl Registry {
    /// Maps a request id to the dp rank that holds its KV, until the request ttl passes.
    pub async fn register_request(
        &self,
        req_id: &str,
        dp_rank: Rank,
    ) -> Result<Inserted, RegistryError> {
        validate_id("req_id", req_id)?;
        validate_rank("dp_rank", dp_rank)?;
        self.check_rank("DP", dp_rank, |e| e.dp_size)?;
        let now = now_ms();
        let record = RequestRecord {
            dp_rank,
            expires_at_ms: now + self.config.request_ttl.as_millis() as u64,
        };
        let inserted =
            lock(&self.requests)
                .of(req_id)
                .insert(req_id, dp_rank, now, record.expires_at_ms)?;
        if inserted == Inserted::New {
            if let Err(err) = self.store.put_request(req_id, record).await {
                lock(&self.requests).of(req_id).remove_if(req_id, record);
                return Err(err.into());
            }
        }
        Ok(inserted)
    }

    /// Where the KV of each id lives for D's tp rank `tp_rank`, in the order asked. D's tp size
    /// must match P's.
    pub fn locate_requests(
        &self,
        req_ids: &[String],
        tp_rank: Rank,
        tp_size: Rank,
    ) -> Result<Vec<Location>, RegistryError> {
        validate_rank("tp_rank", tp_rank)?;
        validate_rank("tp_size", tp_size)?;
        for id in req_ids {
            validate_id("req_ids", id)?;
        }
        // One snapshot for the check and the addresses (computed once per change of the table).
        let view = self.view();
        // With a configured tp size, D's must equal it. Without one, P's is inferred from what
        // has registered so far, which may still be incomplete: only a D tp size below it is
        // certainly a mismatch (missing tp ranks answer per id).
        let mismatch = match (&self.config.expected, view.observed_tp_size()) {
            (Some(expected), _) => (expected.tp_size != tp_size).then_some(expected.tp_size),
            (None, Some(observed)) => (tp_size < observed).then_some(observed),
            (None, None) => None,
        };
        if let Some(expected) = mismatch {
            return Err(RegistryError::TpSizeMismatch {
                expected,
                got: tp_size,
            });
        }
        let now = now_ms();
        let ranks: Vec<Option<Rank>> = {
            let requests = lock(&self.requests);
            req_ids.iter().map(|id| requests.get(id, now)).collect()
        };
        Ok(ranks
            .into_iter()
            .map(|rank| match rank {
                None => Location::Pending,
                Some(dp) if !view.table().has_dp_group(dp) => Location::MissingDpGroup(dp),
                Some(dp) => match view.table().addresses(dp, tp_rank) {
                    addrs if addrs.is_empty() => Location::MissingTpRank { dp, tp: tp_rank },
                    addrs => Location::Ready(addrs),
                },
            })
            .collect())
    }

    /// Maps bootstrap room `room` (SGLang) to the dp rank serving it, for the room ttl; a later
    /// registration of the same room moves it, as SGLang's server does.
    pub async fn register_room(&self, room: u64, dp_rank: Rank) -> Result<(), RegistryError> {
        validate_rank("dp_rank", dp_rank)?;
        let id = room_id(room);
        let now = now_ms();
        let record = RequestRecord {
            dp_rank,
            expires_at_ms: now + self.config.room_ttl.as_millis() as u64,
        };
        {
            let mut tables = lock(&self.requests);
            let rooms = tables.of(&id);
            if rooms.get(&id, now) == Some(dp_rank) {
                return Ok(());
            }
            rooms.remove(&id);
            rooms.insert(&id, dp_rank, now, record.expires_at_ms)?;
        }
        if let Err(err) = self.store.put_request(&id, record).await {
            lock(&self.requests).of(&id).remove_if(&id, record);
            return Err(err.into());
        }
        Ok(())
    }

    /// The dp rank of each bootstrap room asked about, `None` for rooms not (or no longer)
    /// registered.
    pub fn locate_rooms(&self, rooms: &[u64]) -> Vec<Option<Rank>> {
        let now = now_ms();
        let tables = lock(&self.requests);
        rooms
            .iter()
            .map(|room| tables.get(&room_id(*room), now))
            .collect()
    }

    /// Forgets an id after its transfer; true when it was live.
    pub async fn release_request(&self, req_id: &str) -> Result<bool, RegistryError> {
        validate_id("req_id", req_id)?;
        let live = lock(&self.requests).get(req_id, now_ms()).is_some();
        // The store first, also for an id this replica does not hold: a retry after a failed
        // delete (or a release sent to another replica than the registration) still reaches it.
        self.store.remove_requests(&[Arc::from(req_id)]).await?;
        lock(&self.requests).of(req_id).remove(req_id);
        Ok(live)
    }

    /// Removes every expired request id; returns how many.
    pub async fn prune_expired(&self) -> usize {
        let mut total = 0;
        loop {
            let batch = lock(&self.requests).pop_expired(now_ms(), PRUNE_BATCH);
            if batch.is_empty() {
                break;
            }
            total += batch.len();
            if let Err(err) = self.store.forget_expired(&batch).await {
                // The ids are gone from memory; in the store they are dropped as expired at the
                // next load.
                tracing::warn!(error = %err, "could not delete pruned request ids from the store");
            }
        }
        if total > 0 {
            tracing::debug!(pruned = total, "expired request ids pruned");
        }
        total
    }
}
