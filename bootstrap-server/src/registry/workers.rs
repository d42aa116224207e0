//! The worker table: which engine owns each dp rank and where every (dp, tp, pp) worker listens.
//!
//! Planning is pure: [`WorkerTable::plan_register`] and friends turn a request into a
//! [`WorkerChange`] (or a conflict) without touching anything, so the registry can make the change
//! durable first and apply it to memory second.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use pd_protocol::{LeaseId, Rank};

use super::model::{Deregistration, Lease, Slot, WorkerChange, WorkerRecord};

/// What to do when a new engine id registers a dp rank that another engine owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EngineConflictPolicy {
    /// Refuse with vLLM's "Engine ID mismatch" 400, unless the request says `"replace": true`.
    #[default]
    Reject,
    /// The newcomer takes the dp rank over and the old engine's workers of that rank are dropped
    /// (for vLLM clients, which cannot send `replace`, in deployments where a restarted engine
    /// must come back without an operator).
    Replace,
}

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerConflict {
    /// The dp rank belongs to another engine.
    #[error("dp rank {dp_rank} belongs to engine {expected}, not to {got}")]
    EngineMismatch {
        /// The contested dp rank.
        dp_rank: Rank,
        /// The engine that owns it.
        expected: String,
        /// The engine that asked for it.
        got: String,
    },
    /// The slot is registered at another address.
    #[error("the worker at {slot} is registered at {old}, not at {new}")]
    SlotTaken {
        /// The contested slot.
        slot: Slot,
        /// The address on record.
        old: String,
        /// The address asked for.
        new: String,
    },
}

/// How a registration was applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterOutcome {
    /// A new slot was recorded.
    Created,
    /// The exact same registration was already on record (a client retry).
    Replayed,
    /// The slot or the dp rank was taken over; `previous_engine` is who had it.
    Replaced {
        /// The engine that owned the dp rank before, if another one.
        previous_engine: Option<String>,
    },
}

/// A planned change and what it will mean once applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// What to write.
    pub change: WorkerChange,
    /// How to describe it.
    pub outcome: RegisterOutcome,
}

/// All registered workers, grouped by dp rank.
#[derive(Debug, Clone, Default)]
pub struct WorkerTable {
    groups: BTreeMap<Rank, Group>,
}

/// The workers of one dp rank.
#[derive(Debug, Clone, Default)]
pub struct Group {
    engine_id: Option<Arc<str>>,
    workers: BTreeMap<(Rank, Rank), Worker>,
}

impl Group {
    /// The engine that owns the dp rank (none for workers registered without an engine id).
    pub fn engine_id(&self) -> Option<&str> {
        self.engine_id.as_deref()
    }

    /// `(tp rank, pp rank, address)` of every worker, in rank order.
    pub fn workers(&self) -> impl Iterator<Item = (Rank, Rank, &str)> {
        self.workers
            .iter()
            .map(|((tp, pp), worker)| (*tp, *pp, worker.addr.as_str()))
    }
}

/// One slot's registration.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Worker {
    addr: String,
    lease: Option<Lease>,
}

impl WorkerTable {
    /// Builds the table from stored records.
    pub fn from_records(records: Vec<WorkerRecord>) -> Self {
        let mut table = WorkerTable::default();
        table.apply(&WorkerChange {
            remove: Vec::new(),
            put: records,
        });
        table
    }

    /// How many worker slots are registered.
    pub fn worker_count(&self) -> usize {
        self.groups.values().map(|g| g.workers.len()).sum()
    }

    /// How many distinct engines own at least one dp rank.
    pub fn engine_count(&self) -> usize {
        self.groups
            .values()
            .filter_map(|g| g.engine_id.as_deref())
            .collect::<BTreeSet<_>>()
            .len()
    }

    /// True when some dp rank is owned by `engine_id`.
    pub fn has_engine(&self, engine_id: &str) -> bool {
        self.groups
            .values()
            .any(|g| g.engine_id.as_deref() == Some(engine_id))
    }

    /// The largest number of tp ranks registered in one dp group: P's tp size as far as the
    /// registry can tell without a configured one.
    pub fn observed_tp_size(&self) -> Option<Rank> {
        self.groups
            .values()
            .map(|g| {
                g.workers
                    .keys()
                    .map(|(tp, _)| *tp)
                    .collect::<BTreeSet<_>>()
                    .len() as Rank
            })
            .max()
    }

    /// Whether dp rank `dp` has any workers.
    pub fn has_dp_group(&self, dp: Rank) -> bool {
        self.groups.contains_key(&dp)
    }

    /// The addresses of every pp rank of worker (dp, tp), in pp order.
    pub fn addresses(&self, dp: Rank, tp: Rank) -> Vec<String> {
        self.groups
            .get(&dp)
            .map(|g| {
                g.workers
                    .range((tp, 0)..=(tp, Rank::MAX))
                    .map(|(_, worker)| worker.addr.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// How many slots inside `dp x tp x pp` are registered.
    pub fn count_within(&self, dp: Rank, tp: Rank, pp: Rank) -> usize {
        self.groups
            .range(..dp)
            .flat_map(|(_, g)| g.workers.keys())
            .filter(|(t, p)| *t < tp && *p < pp)
            .count()
    }

    /// Every dp rank with workers, in rank order.
    pub fn groups(&self) -> impl Iterator<Item = (Rank, &Group)> {
        self.groups.iter().map(|(dp, group)| (*dp, group))
    }

    /// Plans a registration under an engine id. Arguments must already be validated.
    pub fn plan_register(
        &self,
        engine_id: &str,
        slot: Slot,
        addr: &str,
        replace: bool,
        policy: EngineConflictPolicy,
        lease: Option<Lease>,
    ) -> Result<Plan, WorkerConflict> {
        let new_record = || WorkerRecord {
            slot,
            engine_id: Some(Arc::from(engine_id)),
            addr: addr.to_owned(),
            lease,
        };
        let Some(group) = self.groups.get(&slot.dp) else {
            return Ok(Plan {
                change: WorkerChange {
                    remove: Vec::new(),
                    put: vec![new_record()],
                },
                outcome: RegisterOutcome::Created,
            });
        };
        match group.engine_id.as_deref() {
            Some(owner) if owner != engine_id => {
                if !(replace || policy == EngineConflictPolicy::Replace) {
                    return Err(WorkerConflict::EngineMismatch {
                        dp_rank: slot.dp,
                        expected: owner.to_owned(),
                        got: engine_id.to_owned(),
                    });
                }
                let remove = group
                    .workers
                    .keys()
                    .map(|(tp, pp)| Slot {
                        dp: slot.dp,
                        tp: *tp,
                        pp: *pp,
                    })
                    .collect();
                return Ok(Plan {
                    change: WorkerChange {
                        remove,
                        put: vec![new_record()],
                    },
                    outcome: RegisterOutcome::Replaced {
                        previous_engine: Some(owner.to_owned()),
                    },
                });
            }
            Some(_) => {}
            None => {
                // Workers registered without an engine id: this engine claims the whole group.
                let mut put: Vec<WorkerRecord> = group
                    .workers
                    .iter()
                    .filter(|(key, _)| **key != (slot.tp, slot.pp))
                    .map(|((tp, pp), old)| WorkerRecord {
                        slot: Slot {
                            dp: slot.dp,
                            tp: *tp,
                            pp: *pp,
                        },
                        engine_id: Some(Arc::from(engine_id)),
                        addr: old.addr.clone(),
                        lease: old.lease,
                    })
                    .collect();
                self.check_slot(group, slot, addr, lease, replace)?;
                put.push(new_record());
                return Ok(Plan {
                    change: WorkerChange {
                        remove: Vec::new(),
                        put,
                    },
                    outcome: RegisterOutcome::Created,
                });
            }
        }
        let takeover = replace || policy == EngineConflictPolicy::Replace;
        let outcome = match self.check_slot(group, slot, addr, lease, takeover)? {
            SlotState::Free => RegisterOutcome::Created,
            SlotState::Renewed => RegisterOutcome::Replayed,
            SlotState::Same => {
                return Ok(Plan {
                    change: WorkerChange::default(),
                    outcome: RegisterOutcome::Replayed,
                })
            }
            SlotState::Overwritten => RegisterOutcome::Replaced {
                previous_engine: None,
            },
        };
        Ok(Plan {
            change: WorkerChange {
                remove: Vec::new(),
                put: vec![new_record()],
            },
            outcome,
        })
    }

    fn check_slot(
        &self,
        group: &Group,
        slot: Slot,
        addr: &str,
        lease: Option<Lease>,
        replace: bool,
    ) -> Result<SlotState, WorkerConflict> {
        match group.workers.get(&(slot.tp, slot.pp)) {
            None => Ok(SlotState::Free),
            Some(old) if old.addr == addr && old.lease == lease => Ok(SlotState::Same),
            // The same worker registering again, under a new lease (or none).
            Some(old) if old.addr == addr => Ok(SlotState::Renewed),
            Some(_) if replace => Ok(SlotState::Overwritten),
            Some(old) => Err(WorkerConflict::SlotTaken {
                slot,
                old: old.addr.clone(),
                new: addr.to_owned(),
            }),
        }
    }

    /// Plans a registration without an engine id: the slot is written whatever it held, as
    /// vLLM's `/register_worker` does, keeping the dp rank's engine id if it has one.
    pub fn plan_register_unowned(&self, slot: Slot, addr: &str) -> WorkerChange {
        let group = self.groups.get(&slot.dp);
        if group
            .and_then(|g| g.workers.get(&(slot.tp, slot.pp)))
            .is_some_and(|w| w.addr == addr && w.lease.is_none())
        {
            return WorkerChange::default();
        }
        WorkerChange {
            remove: Vec::new(),
            put: vec![WorkerRecord {
                slot,
                engine_id: group.and_then(|g| g.engine_id.clone()),
                addr: addr.to_owned(),
                lease: None,
            }],
        }
    }

    /// Plans a deregistration: the engine's slots that match the given ranks.
    pub fn plan_deregister(&self, selection: &Deregistration) -> WorkerChange {
        let Deregistration {
            engine_id,
            dp,
            tp,
            pp,
        } = selection;
        let (dp, tp, pp) = (*dp, *tp, *pp);
        let matches = |want: Option<Rank>, have: Rank| want.is_none_or(|w| w == have);
        let remove = self
            .groups
            .iter()
            .filter(|(d, g)| g.engine_id.as_deref() == Some(engine_id.as_str()) && matches(dp, **d))
            .flat_map(|(d, g)| {
                g.workers.keys().map(move |(t, p)| Slot {
                    dp: *d,
                    tp: *t,
                    pp: *p,
                })
            })
            .filter(|slot| matches(tp, slot.tp) && matches(pp, slot.pp))
            .collect();
        WorkerChange {
            remove,
            put: Vec::new(),
        }
    }

    /// Applies a change (already made durable). A dp rank whose last worker goes is freed.
    pub fn apply(&mut self, change: &WorkerChange) {
        for slot in &change.remove {
            if let Some(group) = self.groups.get_mut(&slot.dp) {
                group.workers.remove(&(slot.tp, slot.pp));
                if group.workers.is_empty() {
                    self.groups.remove(&slot.dp);
                }
            }
        }
        for record in &change.put {
            let group = self.groups.entry(record.slot.dp).or_default();
            if record.engine_id.is_some() {
                group.engine_id.clone_from(&record.engine_id);
            }
            group.workers.insert(
                (record.slot.tp, record.slot.pp),
                Worker {
                    addr: record.addr.clone(),
                    lease: record.lease,
                },
            );
        }
    }

    /// The worker registered at `slot`.
    pub fn get(&self, slot: Slot) -> Option<WorkerRecord> {
        let group = self.groups.get(&slot.dp)?;
        let worker = group.workers.get(&(slot.tp, slot.pp))?;
        Some(WorkerRecord {
            slot,
            engine_id: group.engine_id.clone(),
            addr: worker.addr.clone(),
            lease: worker.lease,
        })
    }

    /// Every registered worker, in (dp, tp, pp) order.
    pub fn records(&self) -> impl Iterator<Item = WorkerRecord> + '_ {
        self.groups.iter().flat_map(|(dp, group)| {
            group
                .workers
                .iter()
                .map(move |((tp, pp), worker)| WorkerRecord {
                    slot: Slot {
                        dp: *dp,
                        tp: *tp,
                        pp: *pp,
                    },
                    engine_id: group.engine_id.clone(),
                    addr: worker.addr.clone(),
                    lease: worker.lease,
                })
        })
    }

    /// True when some worker lives by lease `id`.
    pub fn has_lease(&self, id: LeaseId) -> bool {
        self.groups
            .values()
            .flat_map(|g| g.workers.values())
            .any(|w| w.lease.is_some_and(|l| l.id == id))
    }
}

enum SlotState {
    Free,
    Same,
    Renewed,
    Overwritten,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(dp: Rank, tp: Rank, pp: Rank) -> Slot {
        Slot { dp, tp, pp }
    }

    fn registered(entries: &[(&str, Slot, &str)]) -> WorkerTable {
        let mut table = WorkerTable::default();
        for (engine, slot, addr) in entries {
            let plan = table
                .plan_register(
                    engine,
                    *slot,
                    addr,
                    false,
                    EngineConflictPolicy::Reject,
                    None,
                )
                .unwrap();
            table.apply(&plan.change);
        }
        table
    }

    #[test]
    fn replay_is_a_no_op_and_conflicts_use_vllm_wording() {
        let table = registered(&[("A", slot(0, 0, 0), "tcp://h:1")]);
        let replay = table
            .plan_register(
                "A",
                slot(0, 0, 0),
                "tcp://h:1",
                false,
                EngineConflictPolicy::Reject,
                None,
            )
            .unwrap();
        assert_eq!(replay.outcome, RegisterOutcome::Replayed);
        assert!(replay.change.is_empty());

        let err = table
            .plan_register(
                "B",
                slot(0, 1, 0),
                "tcp://h:2",
                false,
                EngineConflictPolicy::Reject,
                None,
            )
            .unwrap_err();
        assert_eq!(
            err,
            WorkerConflict::EngineMismatch {
                dp_rank: 0,
                expected: "A".into(),
                got: "B".into()
            }
        );
        let err = table
            .plan_register(
                "A",
                slot(0, 0, 0),
                "tcp://h:9",
                false,
                EngineConflictPolicy::Reject,
                None,
            )
            .unwrap_err();
        assert_eq!(
            err,
            WorkerConflict::SlotTaken {
                slot: slot(0, 0, 0),
                old: "tcp://h:1".into(),
                new: "tcp://h:9".into()
            }
        );
    }

    #[test]
    fn replace_takes_the_whole_dp_rank_over() {
        let mut table = registered(&[
            ("A", slot(0, 0, 0), "tcp://h:1"),
            ("A", slot(0, 1, 0), "tcp://h:2"),
            ("A", slot(1, 0, 0), "tcp://h:3"),
        ]);
        let plan = table
            .plan_register(
                "B",
                slot(0, 0, 0),
                "tcp://h:4",
                true,
                EngineConflictPolicy::Reject,
                None,
            )
            .unwrap();
        assert_eq!(
            plan.outcome,
            RegisterOutcome::Replaced {
                previous_engine: Some("A".into())
            }
        );
        table.apply(&plan.change);
        let groups: Vec<(Rank, &Group)> = table.groups().collect();
        assert_eq!(groups[0].1.engine_id(), Some("B"));
        assert_eq!(groups[0].1.workers().count(), 1, "A's tp 1 must be gone");
        assert_eq!(groups[1].1.engine_id(), Some("A"));
        assert_eq!(table.engine_count(), 2);

        let policy_plan = table
            .plan_register(
                "C",
                slot(1, 0, 0),
                "tcp://h:5",
                false,
                EngineConflictPolicy::Replace,
                None,
            )
            .unwrap();
        assert!(matches!(
            policy_plan.outcome,
            RegisterOutcome::Replaced { .. }
        ));
    }

    #[test]
    fn deregistered_ranks_are_free_for_a_new_engine() {
        let mut table = registered(&[
            ("A", slot(0, 0, 0), "tcp://h:1"),
            ("A", slot(0, 1, 0), "tcp://h:2"),
        ]);
        let change = table.plan_deregister(&Deregistration {
            engine_id: "A".into(),
            dp: None,
            tp: None,
            pp: None,
        });
        assert_eq!(change.remove.len(), 2);
        table.apply(&change);
        assert_eq!(table.worker_count(), 0);
        assert!(table
            .plan_register(
                "B",
                slot(0, 0, 0),
                "tcp://h:3",
                false,
                EngineConflictPolicy::Reject,
                None
            )
            .is_ok());
    }

    #[test]
    fn counts_and_lookups() {
        let table = registered(&[
            ("A", slot(0, 0, 0), "tcp://h:1"),
            ("A", slot(0, 0, 1), "tcp://h:2"),
            ("A", slot(0, 1, 0), "tcp://h:3"),
            ("B", slot(5, 0, 0), "tcp://h:4"),
        ]);
        assert_eq!(table.addresses(0, 0), vec!["tcp://h:1", "tcp://h:2"]);
        assert!(table.addresses(0, 7).is_empty());
        assert_eq!(table.observed_tp_size(), Some(2));
        assert_eq!(table.count_within(1, 2, 2), 3);
        assert_eq!(table.count_within(6, 1, 1), 2);
        let owned_by_b = table.groups().filter(|(_, g)| g.engine_id() == Some("B"));
        assert_eq!(owned_by_b.count(), 1);
    }

    #[test]
    fn legacy_workers_are_claimed_by_an_engine() {
        let mut table = WorkerTable::default();
        table.apply(&table.plan_register_unowned(slot(0, 1, 0), "tcp://h:1"));
        assert_eq!(table.groups().next().unwrap().1.engine_id(), None);
        let plan = table
            .plan_register(
                "E",
                slot(0, 0, 0),
                "tcp://h:2",
                false,
                EngineConflictPolicy::Reject,
                None,
            )
            .unwrap();
        table.apply(&plan.change);
        assert_eq!(table.groups().next().unwrap().1.engine_id(), Some("E"));
        assert_eq!(table.worker_count(), 2);
    }
}
