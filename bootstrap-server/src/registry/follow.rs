//! How the registry's tables follow the store: loaded from a snapshot, then changed only by the
//! store's events, in order.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};

use pd_protocol::Revision;

use super::model::{Change, ChangeKind, ROOM_PREFIX};
use super::{IdTables, Registry, RegistryConfig, WorkerState};
use crate::registry::model::WorkerChange;
use crate::store::{Snapshot, StoreEvent};
use crate::sync::{lock, now_ms};

impl Registry {
    /// Builds the tables from a snapshot; also returns the ids that had expired.
    pub(super) fn tables(
        snapshot: Snapshot,
        config: &RegistryConfig,
    ) -> (WorkerState, IdTables, Vec<Arc<str>>) {
        let workers = WorkerState::new(snapshot.workers, snapshot.revision, snapshot.guard);
        let mut requests = IdTables::new(config.max_requests);
        let expired = requests.load(snapshot.requests, now_ms());
        (workers, requests, expired)
    }

    /// Applies the store's events until the store or the registry goes away.
    ///
    /// The events wait in the registry, behind a lock, so that the writer can also apply the
    /// ones already there ([`Registry::catch_up`]); whoever takes an event applies it before
    /// letting go of the lock, so they land in order either way.
    pub(super) async fn follow(registry: Weak<Registry>) {
        while std::future::poll_fn(|cx| Self::apply_next(&registry, cx)).await {}
    }

    /// Applies the next event once there is one; false once the store or the registry is gone.
    fn apply_next(registry: &Weak<Registry>, cx: &mut Context<'_>) -> Poll<bool> {
        let Some(registry) = registry.upgrade() else {
            return Poll::Ready(false);
        };
        let mut events = lock(&registry.events);
        match events.poll_recv(cx) {
            Poll::Ready(Some(event)) => {
                registry.apply(event);
                Poll::Ready(true)
            }
            Poll::Ready(None) => Poll::Ready(false),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Applies every event the store has already reported.
    pub(super) fn catch_up(&self) {
        let mut events = lock(&self.events);
        while let Ok(event) = events.try_recv() {
            self.apply(event);
        }
    }

    fn apply(&self, event: StoreEvent) {
        let revision = match event {
            StoreEvent::Workers {
                revision,
                remove,
                put,
                guard,
            } => {
                let mut state = self.write_workers();
                let mut events: Vec<Change> = remove
                    .iter()
                    .filter_map(|slot| state.table.get(*slot))
                    .map(|old| Change {
                        revision,
                        kind: ChangeKind::Delete,
                        worker: old,
                    })
                    .collect();
                if !guard {
                    // Not a registry commit: a lease ended (expired, or revoked) and took these.
                    let ended = events.len() as u64;
                    self.lease_removals.fetch_add(ended, Ordering::Relaxed);
                }
                events.extend(put.iter().map(|new| Change {
                    revision,
                    kind: ChangeKind::Put,
                    worker: new.clone(),
                }));
                state.table.apply(&WorkerChange { remove, put });
                if guard {
                    state.guard = revision;
                }
                state.unpublished = true;
                let shown = !state.holding && state.publish();
                state.history.extend(events);
                self.revision.fetch_max(revision, Ordering::Release);
                drop(state);
                if shown {
                    self.shown.send_replace(());
                }
                revision
            }
            StoreEvent::Requests {
                revision,
                put,
                remove,
            } => {
                let now = now_ms();
                let mut requests = lock(&self.requests);
                for (id, record) in put {
                    // Conflicts and a full table were answered to the replica that wrote the id.
                    let table = requests.of(&id);
                    if id.starts_with(ROOM_PREFIX) {
                        // A room is moved by a later registration (SGLang's last write wins).
                        table.remove(&id);
                    }
                    let _ = table.insert(&id, record.dp_rank, now, record.expires_at_ms);
                }
                for id in remove {
                    requests.of(&id).remove(&id);
                }
                drop(requests);
                // Not part of the watched history: no watcher wakes up for request ids.
                self.revision.fetch_max(revision, Ordering::Release);
                return;
            }
            StoreEvent::Progress { revision } => {
                self.revision.fetch_max(revision, Ordering::Release);
                return;
            }
            StoreEvent::Reset(snapshot) => {
                let revision = snapshot.revision;
                let (workers, requests, _) = Self::tables(snapshot, &self.config);
                let mut state = self.write_workers();
                *state = workers;
                *lock(&self.requests) = requests;
                self.revision.fetch_max(revision, Ordering::Release);
                drop(state);
                self.shown.send_replace(());
                tracing::warn!(revision, "registry reloaded from the store");
                revision
            }
        };
        self.applied.send_if_modified(|applied| {
            let advanced = revision > *applied;
            *applied = (*applied).max(revision);
            advanced
        });
    }

    /// The revision the tables are current at.
    pub(super) fn revision(&self) -> Revision {
        self.revision.load(Ordering::Acquire)
    }
}
