//! The recent history of worker changes, which `GET /watch` serves.

use std::collections::VecDeque;

use pd_protocol::Revision;

use super::model::Change;

/// The most recent worker events kept; a watcher further behind re-lists.
pub const HISTORY_CAPACITY: usize = 10_000;

/// The caller's revision is older than the history kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compacted {
    /// The oldest revision a watcher can resume from.
    pub floor: Revision,
}

/// Every worker event after revision `floor`, oldest first, at most `capacity` of them.
#[derive(Debug)]
pub struct History {
    events: VecDeque<Change>,
    floor: Revision,
    capacity: usize,
}

impl History {
    /// An empty history: complete after `floor`.
    pub fn new(floor: Revision, capacity: usize) -> Self {
        History {
            events: VecDeque::new(),
            floor,
            capacity,
        }
    }

    /// Forgets everything: the history is complete again only after `floor`.
    pub fn reset(&mut self, floor: Revision) {
        self.events.clear();
        self.floor = floor;
    }

    /// Appends events (in revision order), dropping the oldest beyond the capacity.
    pub fn extend(&mut self, events: impl IntoIterator<Item = Change>) {
        self.events.extend(events);
        while self.events.len() > self.capacity {
            if let Some(dropped) = self.events.pop_front() {
                // Events of one revision go together: the floor moves past the whole revision.
                self.floor = dropped.revision;
                while self
                    .events
                    .front()
                    .is_some_and(|e| e.revision == dropped.revision)
                {
                    self.events.pop_front();
                }
            }
        }
    }

    /// The events after `since` up to `until` (both revisions), or [`Compacted`] when some of
    /// them are no longer kept.
    pub fn between(&self, since: Revision, until: Revision) -> Result<Vec<Change>, Compacted> {
        if since < self.floor {
            return Err(Compacted { floor: self.floor });
        }
        let start = self.events.partition_point(|e| e.revision <= since);
        let end = self.events.partition_point(|e| e.revision <= until);
        Ok(self.events.range(start..end.max(start)).cloned().collect())
    }

    /// The last `n` events up to `until` (the newest last).
    pub fn latest(&self, n: usize, until: Revision) -> Vec<Change> {
        let end = self.events.partition_point(|e| e.revision <= until);
        let start = end.saturating_sub(n);
        self.events.range(start..end).cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::model::{ChangeKind, Slot, WorkerRecord};

    fn event(revision: Revision, dp_rank: u32) -> Change {
        Change {
            revision,
            kind: ChangeKind::Put,
            worker: WorkerRecord {
                slot: Slot {
                    dp: dp_rank,
                    cp: 0,
                    tp: 0,
                    pp: 0,
                },
                engine_id: None,
                addr: "tcp://h:1".into(),
                lease: None,
                incarnation: 0,
                meta: Default::default(),
                extra: Default::default(),
                draining: false,
            },
        }
    }

    #[test]
    fn serves_what_it_keeps_and_refuses_what_it_dropped() {
        let mut history = History::new(5, 3);
        assert_eq!(history.between(5, 99), Ok(vec![]));
        assert_eq!(history.between(4, 99), Err(Compacted { floor: 5 }));
        history.extend([event(6, 0), event(6, 1), event(8, 2)]);
        assert_eq!(history.between(6, 99), Ok(vec![event(8, 2)]));
        assert_eq!(history.between(5, 99).unwrap().len(), 3);
        // Nothing after the bound, however many events are kept.
        assert_eq!(history.between(5, 7).unwrap().len(), 2);
        assert_eq!(history.between(6, 7), Ok(vec![]));
        // A fourth event pushes revision 6 (both of its events) out.
        history.extend([event(9, 3)]);
        assert_eq!(history.between(5, 99), Err(Compacted { floor: 6 }));
        assert_eq!(history.between(6, 99), Ok(vec![event(8, 2), event(9, 3)]));
        history.reset(20);
        assert_eq!(history.between(9, 99), Err(Compacted { floor: 20 }));
        assert_eq!(history.between(25, 99), Ok(vec![]));
    }
}
