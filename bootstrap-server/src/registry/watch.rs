//! `GET /workers` and `GET /watch`: the worker table with its revision, and the changes after a
//! revision, waited for.

use std::time::Duration;

use pd_protocol::native::{WatchBatch, WorkerInfo, WorkerList};
use pd_protocol::Revision;

use super::{Compacted, Registry, RegistryError};
use crate::store::WorkerRecord;

/// The wire form of a stored worker.
pub(super) fn worker_info(record: &WorkerRecord) -> WorkerInfo {
    WorkerInfo {
        engine_id: record.engine_id.as_deref().map(str::to_owned),
        dp_rank: record.slot.dp,
        tp_rank: record.slot.tp,
        pp_rank: record.slot.pp,
        addr: record.addr.clone(),
        lease_id: record.lease.map(|l| l.id),
    }
}

impl Registry {
    /// `GET /workers`: every registered worker, with the revision to watch from.
    pub fn list(&self) -> WorkerList {
        let state = self.read_workers();
        WorkerList {
            // Read under the lock: no worker change can land between the table and the number.
            revision: self.revision(),
            workers: state.table.records().map(|r| worker_info(&r)).collect(),
        }
    }

    /// `GET /watch?since=REV`: the worker changes after `since`, waiting up to `wait` for the
    /// first one. An empty batch means the wait ran out. A `since` ahead of this replica is
    /// waited for (another replica may be a little ahead) and refused if it is still ahead when
    /// the wait runs out.
    pub async fn watch(
        &self,
        since: Revision,
        wait: Duration,
    ) -> Result<WatchBatch, RegistryError> {
        let mut applied = self.applied.subscribe();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Marked seen before the history is read, so no change can slip in between.
            applied.borrow_and_update();
            let current = {
                let state = self.read_workers();
                let revision = self.revision();
                let events = state.history.since(since).map_err(|Compacted { floor }| {
                    RegistryError::Compacted {
                        since,
                        floor,
                        revision,
                    }
                })?;
                if !events.is_empty() {
                    return Ok(WatchBatch { revision, events });
                }
                revision
            };
            match tokio::time::timeout_at(deadline, applied.changed()).await {
                Ok(Ok(())) => continue,
                // Out of time (or the registry is going away): nothing new.
                _ if current < since => {
                    return Err(RegistryError::AheadOfRegistry {
                        since,
                        revision: current,
                    })
                }
                _ => {
                    return Ok(WatchBatch {
                        revision: current,
                        events: Vec::new(),
                    })
                }
            }
        }
    }
}
