//! Leases for the embedded store: which worker slots each lease keeps alive, and when it expires.
//!
//! etcd keeps leases itself; sled has none, so [`SledStore`](super::SledStore) keeps them here, in
//! memory. The lease of a stored worker is written with the worker, so a restart restores every
//! lease with a full time to live (a grace period for workers to send their next keepalive).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use pd_protocol::LeaseId;

use crate::registry::model::{Slot, WorkerChange};

#[derive(Debug)]
struct Entry {
    ttl: u32,
    deadline: Instant,
    slots: BTreeSet<Slot>,
}

/// Live leases and the slots registered under each.
#[derive(Debug, Default)]
pub(super) struct SledLeases {
    leases: HashMap<LeaseId, Entry>,
    owner: HashMap<Slot, LeaseId>,
    /// Ended leases whose workers could not be removed yet (a failed write): tried again.
    unremoved: Vec<(LeaseId, Vec<Slot>)>,
}

fn deadline(now: Instant, ttl: u32) -> Instant {
    now + Duration::from_secs(u64::from(ttl))
}

impl SledLeases {
    /// Grants a new lease of `ttl` seconds.
    pub(super) fn grant(&mut self, ttl: u32, now: Instant) -> LeaseId {
        loop {
            // Positive, like etcd's, and unguessable enough that one worker cannot keep another
            // worker's lease alive by accident.
            let id = (uuid::Uuid::new_v4().as_u64_pair().0 >> 1) as LeaseId;
            if id != 0 && !self.leases.contains_key(&id) {
                self.leases.insert(
                    id,
                    Entry {
                        ttl,
                        deadline: deadline(now, ttl),
                        slots: BTreeSet::new(),
                    },
                );
                return id;
            }
        }
    }

    /// Restores a stored worker's lease with a full time to live.
    pub(super) fn restore(&mut self, id: LeaseId, ttl: u32, slot: Slot, now: Instant) {
        let entry = self.leases.entry(id).or_insert_with(|| Entry {
            ttl,
            deadline: deadline(now, ttl),
            slots: BTreeSet::new(),
        });
        entry.slots.insert(slot);
        self.owner.insert(slot, id);
    }

    /// True when `id` is live.
    pub(super) fn is_live(&self, id: LeaseId) -> bool {
        self.leases.contains_key(&id)
    }

    /// How long a lease lives without another keepalive; `None` when it is not live.
    pub(super) fn remaining(&self, id: LeaseId, now: Instant) -> Option<Duration> {
        let entry = self.leases.get(&id)?;
        Some(entry.deadline.saturating_duration_since(now))
    }

    /// Renews a lease; its time to live, or `None` when it is not live.
    pub(super) fn keep_alive(&mut self, id: LeaseId, now: Instant) -> Option<u32> {
        let entry = self.leases.get_mut(&id)?;
        entry.deadline = deadline(now, entry.ttl);
        Some(entry.ttl)
    }

    /// Ends a lease; the slots it kept alive, or `None` when it was not live.
    pub(super) fn revoke(&mut self, id: LeaseId) -> Option<Vec<Slot>> {
        let entry = self.leases.remove(&id)?;
        for slot in &entry.slots {
            self.owner.remove(slot);
        }
        Some(entry.slots.into_iter().collect())
    }

    /// Ends every lease whose deadline has passed; each one's slots (with those of ended leases
    /// whose removal failed before).
    pub(super) fn take_expired(&mut self, now: Instant) -> Vec<(LeaseId, Vec<Slot>)> {
        let expired: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, entry)| entry.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        let mut ended = std::mem::take(&mut self.unremoved);
        ended.extend(
            expired
                .into_iter()
                .filter_map(|id| Some((id, self.revoke(id)?))),
        );
        ended
    }

    /// Keeps an ended lease's slots for the next [`SledLeases::take_expired`]: removing them
    /// failed.
    pub(super) fn retry_removal(&mut self, id: LeaseId, slots: Vec<Slot>) {
        self.unremoved.push((id, slots));
    }

    /// Follows a committed change: removed or overwritten slots leave their lease, slots written
    /// with a lease join it.
    pub(super) fn track(&mut self, change: &WorkerChange) {
        let touched = change
            .remove
            .iter()
            .copied()
            .chain(change.put.iter().map(|w| w.slot));
        for slot in touched {
            if let Some(id) = self.owner.remove(&slot) {
                if let Some(entry) = self.leases.get_mut(&id) {
                    entry.slots.remove(&slot);
                }
            }
        }
        for worker in &change.put {
            if let Some(lease) = worker.lease {
                if let Some(entry) = self.leases.get_mut(&lease.id) {
                    entry.slots.insert(worker.slot);
                    self.owner.insert(worker.slot, lease.id);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::registry::model::{Lease, WorkerRecord};

    fn slot(dp: u32) -> Slot {
        Slot {
            dp,
            cp: 0,
            tp: 0,
            pp: 0,
        }
    }

    fn put(dp: u32, lease: Option<Lease>) -> WorkerChange {
        WorkerChange {
            remove: vec![],
            put: vec![WorkerRecord {
                slot: slot(dp),
                engine_id: Some(Arc::from("e")),
                addr: "tcp://h:1".into(),
                lease,
                incarnation: 0,
                meta: Default::default(),
                extra: Default::default(),
                draining: false,
            }],
        }
    }

    #[test]
    fn leases_expire_with_their_slots_unless_kept_alive() {
        let start = Instant::now();
        let mut leases = SledLeases::default();
        let short = leases.grant(1, start);
        let long = leases.grant(10, start);
        leases.track(&put(0, Some(Lease { id: short, ttl: 1 })));
        leases.track(&put(1, Some(Lease { id: long, ttl: 10 })));
        // Overwriting slot 1 without a lease takes it out of the long lease.
        leases.track(&put(1, None));
        leases.track(&put(2, Some(Lease { id: long, ttl: 10 })));

        assert!(leases.take_expired(start).is_empty());
        let later = start + Duration::from_millis(1500);
        assert_eq!(leases.take_expired(later), vec![(short, vec![slot(0)])]);
        assert!(!leases.is_live(short));
        assert_eq!(leases.keep_alive(short, later), None);

        assert_eq!(leases.keep_alive(long, later), Some(10));
        assert!(leases
            .take_expired(start + Duration::from_secs(10))
            .is_empty());
        assert_eq!(leases.revoke(long), Some(vec![slot(2)]));
        assert_eq!(leases.revoke(long), None);
    }
}
