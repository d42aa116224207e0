//! The worker table with its revision, and the changes after a revision, waited for (what the
//! native `GET /workers` and `GET /watch` serve).

use std::time::Duration;

use pd_protocol::{LeaseId, Revision};

use super::model::{Change, WorkerRecord};
use super::{Compacted, Registry, RegistryError};

/// The changes after a revision, and the revision the watcher is then current at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changes {
    /// Where the watcher stands after these changes: the next `since`.
    pub revision: Revision,
    /// The changes, oldest first (empty when the wait ran out).
    pub changes: Vec<Change>,
}

impl Registry {
    /// Every registered worker (as far as durable), with the revision to watch from.
    pub fn list(&self) -> (Revision, Vec<WorkerRecord>) {
        let state = self.read_workers();
        // Read under the lock: no worker change can land between the table and the number.
        let revision = self.visible_revision(&state);
        (revision, state.published.records().collect())
    }

    /// The last `n` worker changes shown (the newest last), as far as the history keeps them.
    pub fn recent_changes(&self, n: usize) -> Vec<Change> {
        let state = self.read_workers();
        let revision = self.visible_revision(&state);
        state.history.latest(n, revision)
    }

    /// How long `lease` lives without another keepalive, as the store says; `None` when it is
    /// not live (or the store cannot tell now).
    pub async fn lease_remaining(&self, lease: LeaseId) -> Option<Duration> {
        self.store.lease_remaining(lease).await.ok().flatten()
    }

    /// The worker changes after `since`, waiting up to `wait` for the
    /// first one. An empty batch means the wait ran out. A `since` ahead of this replica is
    /// waited for (another replica may be a little ahead) and refused if it is still ahead when
    /// the wait runs out.
    pub async fn watch(&self, since: Revision, wait: Duration) -> Result<Changes, RegistryError> {
        let mut shown = self.shown.subscribe();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Marked seen before the history is read, so no change can slip in between.
            shown.borrow_and_update();
            let current = {
                let state = self.read_workers();
                // Changes held back until their flush are not shown yet.
                let revision = self.visible_revision(&state);
                let events =
                    state
                        .history
                        .between(since, revision)
                        .map_err(|Compacted { floor }| RegistryError::Compacted {
                            since,
                            floor,
                            revision,
                        })?;
                if !events.is_empty() {
                    return Ok(Changes {
                        revision,
                        changes: events,
                    });
                }
                revision
            };
            match tokio::time::timeout_at(deadline, shown.changed()).await {
                Ok(Ok(())) => continue,
                // Out of time (or the registry is going away): nothing new.
                _ if current < since => {
                    return Err(RegistryError::AheadOfRegistry {
                        since,
                        revision: current,
                    })
                }
                _ => {
                    return Ok(Changes {
                        revision: current,
                        changes: Vec::new(),
                    })
                }
            }
        }
    }
}
