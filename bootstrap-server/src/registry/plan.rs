//! Planning worker changes: a registration or deregistration becomes a [`WorkerChange`] (or a
//! conflict) without touching anything, so the registry can make the change durable first and
//! apply it to memory second.
//!
//! The takeover rule: a registration whose slot is held by another engine's worker, or by the
//! same engine's worker at another address (a restarted engine with a pinned id), takes the
//! slot over unless the policy or the request says not to. The engine that held it leaves as a
//! whole, every dp rank and worker of it, so that readers never see half of the old and half of
//! the new; the newcomer's registration is a new incarnation of its engine.

use std::sync::Arc;

use pd_protocol::Rank;

use super::model::{Deregistration, Lease, Registration, Slot, WorkerChange, WorkerRecord};
use super::workers::{Group, WorkerTable};

/// What a registration does to a slot or dp rank held by another engine (or by the same engine
/// at another address).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum EngineConflictPolicy {
    /// Refuse with vLLM's "Engine ID mismatch" / "already registered" 400, unless the request
    /// says `"replace": true`.
    Reject,
    /// The newcomer takes over, unless the request says `"replace": false`; the engine that held
    /// the slot leaves as a whole. What a restarted vLLM P needs: it cannot send `replace`.
    #[default]
    #[value(alias = "takeover")]
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
    /// The exact same registration was already on record (a client retry): nothing changed.
    Replayed,
    /// The same worker registered again (a new lease or new metadata), same incarnation.
    Renewed,
    /// The slot was taken over: the engine that held it (`None`: workers without an engine id)
    /// left, with every worker of it.
    TakenOver {
        /// The engine that held the slot or dp rank.
        previous_engine: Option<String>,
        /// Its incarnation.
        previous_incarnation: u64,
        /// How many of its workers left.
        removed: usize,
    },
}

/// A planned change and what it will mean once applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// What to write.
    pub change: WorkerChange,
    /// How to describe it.
    pub outcome: RegisterOutcome,
    /// The incarnation the registered worker has.
    pub incarnation: u64,
}

impl WorkerTable {
    /// Plans a registration under an engine id (arguments already validated). `lease` is the
    /// lease it will live by; `next_incarnation` is the incarnation a new one gets (greater than
    /// every incarnation on record); `takeover` is the policy's default when the request does not
    /// say.
    pub fn plan_register(
        &self,
        reg: &Registration,
        lease: Option<Lease>,
        takeover: bool,
        next_incarnation: u64,
    ) -> Result<Plan, WorkerConflict> {
        let takeover = reg.replace.unwrap_or(takeover);
        let slot = reg.slot;
        let own_incarnation = self.incarnation(&reg.engine_id);
        // A drain mark belongs to the engine id: its workers joining, renewing or restarting
        // keep it until the operator lifts it.
        let draining = self.draining(&reg.engine_id);
        let record = |incarnation| WorkerRecord {
            slot,
            engine_id: Some(Arc::from(reg.engine_id.as_str())),
            addr: reg.addr.clone(),
            lease,
            incarnation,
            meta: Arc::new(reg.meta.clone()),
            extra: Arc::new(reg.extra.clone()),
            draining,
        };
        let joined = own_incarnation.unwrap_or(next_incarnation);
        let Some(group) = self.group(slot.dp) else {
            return Ok(Plan::put(record(joined), RegisterOutcome::Created));
        };
        match group.engine_id() {
            Some(owner) if owner != reg.engine_id => {
                if !takeover {
                    return Err(WorkerConflict::EngineMismatch {
                        dp_rank: slot.dp,
                        expected: owner.to_owned(),
                        got: reg.engine_id.clone(),
                    });
                }
                Ok(self.take_over(owner, record(joined)))
            }
            None => Ok(self.claim(group, record(joined), takeover)?),
            Some(_) => match group.worker(slot) {
                None => Ok(Plan::put(record(joined), RegisterOutcome::Created)),
                Some(old) if old.addr == reg.addr => {
                    let new = record(old.incarnation);
                    if old.lease == lease && *old.meta == reg.meta && *old.extra == reg.extra {
                        return Ok(Plan {
                            change: WorkerChange::default(),
                            outcome: RegisterOutcome::Replayed,
                            incarnation: old.incarnation,
                        });
                    }
                    Ok(Plan::put(new, RegisterOutcome::Renewed))
                }
                // The same engine id at a new address: a restart with a pinned id.
                Some(_) if takeover => Ok(self.take_over(&reg.engine_id, record(next_incarnation))),
                Some(old) => Err(WorkerConflict::SlotTaken {
                    slot,
                    old: old.addr.clone(),
                    new: reg.addr.clone(),
                }),
            },
        }
    }

    /// Every worker of `engine` goes and `new` is written.
    fn take_over(&self, engine: &str, new: WorkerRecord) -> Plan {
        let remove: Vec<Slot> = self
            .engine_groups(engine)
            .flat_map(|(dp, group)| group.slots(dp))
            .filter(|slot| *slot != new.slot)
            .collect();
        let outcome = RegisterOutcome::TakenOver {
            previous_engine: Some(engine.to_owned()),
            previous_incarnation: self.incarnation(engine).unwrap_or(0),
            removed: remove.len() + usize::from(self.get(new.slot).is_some()),
        };
        let incarnation = new.incarnation;
        Plan {
            change: WorkerChange {
                remove,
                put: vec![new],
            },
            outcome,
            incarnation,
        }
    }

    /// A dp rank of workers registered without an engine id is claimed by `new`'s engine: they
    /// keep their addresses and join it; `new`'s own slot follows the takeover rule.
    fn claim(
        &self,
        group: &Group,
        new: WorkerRecord,
        takeover: bool,
    ) -> Result<Plan, WorkerConflict> {
        let slot = new.slot;
        let held = group.worker(slot);
        if let Some(old) = held.filter(|old| old.addr != new.addr && !takeover) {
            return Err(WorkerConflict::SlotTaken {
                slot,
                old: old.addr.clone(),
                new: new.addr.clone(),
            });
        }
        let mut put: Vec<WorkerRecord> = group
            .slots(slot.dp)
            .filter(|other| *other != slot)
            .filter_map(|other| self.get(other))
            .map(|old| WorkerRecord {
                engine_id: new.engine_id.clone(),
                incarnation: new.incarnation,
                meta: new.meta.clone(),
                extra: new.extra.clone(),
                draining: new.draining,
                ..old
            })
            .collect();
        let incarnation = new.incarnation;
        put.push(new);
        Ok(Plan {
            change: WorkerChange {
                remove: Vec::new(),
                put,
            },
            outcome: RegisterOutcome::Created,
            incarnation,
        })
    }

    /// Plans a registration without an engine id: the slot is written whatever it held, as
    /// vLLM's `/register_worker` does, keeping the dp rank's engine id if it has one.
    pub fn plan_register_unowned(&self, slot: Slot, addr: &str) -> WorkerChange {
        let group = self.group(slot.dp);
        let held = group.and_then(|g| g.worker(slot));
        if held.is_some_and(|w| w.addr == addr && w.lease.is_none()) {
            return WorkerChange::default();
        }
        let engine_id = group.and_then(|g| g.engine_id()).map(Arc::from);
        let incarnation = engine_id
            .as_deref()
            .and_then(|engine| self.incarnation(engine))
            .unwrap_or(0);
        WorkerChange {
            remove: Vec::new(),
            put: vec![WorkerRecord {
                slot,
                engine_id,
                addr: addr.to_owned(),
                lease: None,
                incarnation,
                meta: held.map(|w| w.meta.clone()).unwrap_or_default(),
                extra: held.map(|w| w.extra.clone()).unwrap_or_default(),
                draining: held.is_some_and(|w| w.draining),
            }],
        }
    }

    /// Plans marking every worker of `engine_id` draining (or not); `None` when the engine has
    /// no workers. The count is the engine's workers, marked now or before.
    pub fn plan_drain(&self, engine_id: &str, draining: bool) -> Option<(WorkerChange, usize)> {
        let workers: Vec<WorkerRecord> = self
            .engine_groups(engine_id)
            .flat_map(|(dp, group)| group.slots(dp))
            .filter_map(|slot| self.get(slot))
            .collect();
        if workers.is_empty() {
            return None;
        }
        let count = workers.len();
        let put = workers
            .into_iter()
            .filter(|worker| worker.draining != draining)
            .map(|worker| WorkerRecord { draining, ..worker })
            .collect();
        Some((
            WorkerChange {
                remove: Vec::new(),
                put,
            },
            count,
        ))
    }

    /// Plans a deregistration: the engine's slots that match the given ranks.
    pub fn plan_deregister(&self, selection: &Deregistration) -> WorkerChange {
        let matches = |want: Option<Rank>, have: Rank| want.is_none_or(|w| w == have);
        let remove = self
            .engine_groups(&selection.engine_id)
            .filter(|(dp, _)| matches(selection.dp, *dp))
            .flat_map(|(dp, group)| group.slots(dp))
            .filter(|slot| matches(selection.tp, slot.tp) && matches(selection.pp, slot.pp))
            .collect();
        WorkerChange {
            remove,
            put: Vec::new(),
        }
    }
}

impl Plan {
    fn put(record: WorkerRecord, outcome: RegisterOutcome) -> Self {
        let incarnation = record.incarnation;
        Plan {
            change: WorkerChange {
                remove: Vec::new(),
                put: vec![record],
            },
            outcome,
            incarnation,
        }
    }
}

#[cfg(test)]
mod tests {
    use pd_protocol::native::EngineMeta;

    use super::*;

    fn slot(dp: Rank, tp: Rank, pp: Rank) -> Slot {
        Slot { dp, cp: 0, tp, pp }
    }

    fn reg(engine: &str, slot: Slot, addr: &str) -> Registration {
        Registration {
            engine_id: engine.into(),
            slot,
            addr: addr.into(),
            replace: None,
            lease_ttl: None,
            meta: EngineMeta::default(),
            extra: Default::default(),
        }
    }

    /// Plans and applies `registration` with the given default policy, as the registry does
    /// with incarnations from an ever-growing guard.
    fn register(
        table: &mut WorkerTable,
        next: &mut u64,
        registration: &Registration,
        takeover: bool,
    ) -> Result<Plan, WorkerConflict> {
        *next += 1;
        let plan = table.plan_register(registration, None, takeover, *next)?;
        table.apply(&plan.change);
        Ok(plan)
    }

    fn registered(entries: &[(&str, Slot, &str)]) -> (WorkerTable, u64) {
        let (mut table, mut next) = (WorkerTable::default(), 0);
        for (engine, slot, addr) in entries {
            register(&mut table, &mut next, &reg(engine, *slot, addr), false).unwrap();
        }
        (table, next)
    }

    fn engines(table: &WorkerTable) -> Vec<(Rank, Option<&str>, usize)> {
        table
            .groups()
            .map(|(dp, g)| (dp, g.engine_id(), g.workers().count()))
            .collect()
    }

    #[test]
    fn replays_are_no_ops_and_rejecting_policy_refuses_conflicts() {
        let (table, _) = registered(&[("A", slot(0, 0, 0), "tcp://h:1")]);
        let replay = table
            .plan_register(&reg("A", slot(0, 0, 0), "tcp://h:1"), None, false, 9)
            .unwrap();
        assert_eq!(replay.outcome, RegisterOutcome::Replayed);
        assert!(replay.change.is_empty());
        assert_eq!(
            table.plan_register(&reg("B", slot(0, 1, 0), "tcp://h:2"), None, false, 9),
            Err(WorkerConflict::EngineMismatch {
                dp_rank: 0,
                expected: "A".into(),
                got: "B".into()
            })
        );
        assert_eq!(
            table.plan_register(&reg("A", slot(0, 0, 0), "tcp://h:9"), None, false, 9),
            Err(WorkerConflict::SlotTaken {
                slot: slot(0, 0, 0),
                old: "tcp://h:1".into(),
                new: "tcp://h:9".into()
            })
        );
        // `"replace": false` refuses even under the takeover policy.
        let refuse = Registration {
            replace: Some(false),
            ..reg("B", slot(0, 0, 0), "tcp://h:2")
        };
        assert!(table.plan_register(&refuse, None, true, 9).is_err());
    }

    #[test]
    fn a_new_engine_takes_over_and_the_old_one_leaves_whole() {
        let (mut table, mut next) = registered(&[
            ("A", slot(0, 0, 0), "tcp://h:1"),
            ("A", slot(0, 1, 0), "tcp://h:2"),
            ("C", slot(1, 0, 0), "tcp://h:3"),
        ]);
        let old = table.incarnation("A").unwrap();
        let plan = register(
            &mut table,
            &mut next,
            &reg("B", slot(0, 0, 0), "tcp://h:4"),
            true,
        )
        .unwrap();
        assert_eq!(
            plan.outcome,
            RegisterOutcome::TakenOver {
                previous_engine: Some("A".into()),
                previous_incarnation: old,
                removed: 2
            }
        );
        assert!(plan.incarnation > old);
        assert_eq!(
            engines(&table),
            vec![(0, Some("B"), 1), (1, Some("C"), 1)],
            "A's tp 1 left with it"
        );
        // B's other workers join its incarnation.
        let joined = register(
            &mut table,
            &mut next,
            &reg("B", slot(0, 1, 0), "tcp://h:5"),
            true,
        )
        .unwrap();
        assert_eq!(joined.outcome, RegisterOutcome::Created);
        assert_eq!(joined.incarnation, plan.incarnation);
    }

    #[test]
    fn a_pinned_engine_id_at_new_addresses_is_a_new_incarnation() {
        let (mut table, mut next) = registered(&[
            ("A", slot(0, 0, 0), "tcp://h:1"),
            ("A", slot(0, 1, 0), "tcp://h:2"),
        ]);
        let old = table.incarnation("A").unwrap();
        let restart = register(
            &mut table,
            &mut next,
            &reg("A", slot(0, 0, 0), "tcp://n:1"),
            true,
        )
        .unwrap();
        assert!(matches!(
            restart.outcome,
            RegisterOutcome::TakenOver { removed: 2, .. }
        ));
        assert!(restart.incarnation > old);
        assert_eq!(
            table.addresses(0, 1),
            Vec::<String>::new(),
            "the old tp 1 left"
        );
        let second = register(
            &mut table,
            &mut next,
            &reg("A", slot(0, 1, 0), "tcp://n:2"),
            true,
        )
        .unwrap();
        assert_eq!(second.incarnation, restart.incarnation);
        assert_eq!(table.incarnation("A"), Some(restart.incarnation));
    }

    #[test]
    fn a_new_lease_or_metadata_renews_without_a_new_incarnation() {
        let (table, _) = registered(&[("A", slot(0, 0, 0), "tcp://h:1")]);
        let lease = Lease { id: 7, ttl: 5 };
        let renewed = table
            .plan_register(&reg("A", slot(0, 0, 0), "tcp://h:1"), Some(lease), true, 99)
            .unwrap();
        assert_eq!(renewed.outcome, RegisterOutcome::Renewed);
        assert_eq!(renewed.incarnation, table.incarnation("A").unwrap());
    }

    #[test]
    fn deregistered_ranks_are_free_for_a_new_engine() {
        let (mut table, _) = registered(&[
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
            .plan_register(&reg("B", slot(0, 0, 0), "tcp://h:3"), None, false, 9)
            .is_ok());
    }

    #[test]
    fn counts_and_lookups() {
        let (table, _) = registered(&[
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
        assert_eq!(table.engine_count(), 2);
    }

    #[test]
    fn workers_without_an_engine_id_are_claimed_by_an_engine() {
        let mut table = WorkerTable::default();
        table.apply(&table.plan_register_unowned(slot(0, 1, 0), "tcp://h:1"));
        assert_eq!(engines(&table), vec![(0, None, 1)]);
        let plan = table
            .plan_register(&reg("E", slot(0, 0, 0), "tcp://h:2"), None, false, 5)
            .unwrap();
        table.apply(&plan.change);
        assert_eq!(engines(&table), vec![(0, Some("E"), 2)]);
        assert_eq!(table.incarnation("E"), Some(5));
    }
}
