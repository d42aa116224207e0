//! The worker table: which engine owns each dp rank and where every (dp, tp, pp) worker listens,
//! with each worker's lease, incarnation and engine metadata. Changes are planned elsewhere
//! ([`super::plan`]) and applied here once durable.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use pd_protocol::native::EngineMeta;
use pd_protocol::{LeaseId, Rank};

use super::model::{Extra, Lease, Slot, WorkerChange, WorkerRecord};

/// All registered workers, grouped by dp rank.
///
/// The maps are persistent (`imbl`): a copy of the table (a [`super::View`] after every write,
/// a writer planning merged changes) shares everything with the original and costs the same
/// whatever the table's size, and a change copies only the path to what it touches and the
/// groups it changes.
///
/// The dp ranks of each engine are indexed, so what a registration asks about its engine
/// (incarnation, drain mark, ranks) costs that engine's ranks, not the table's; the totals a
/// view reports are kept with every change.
#[derive(Debug, Clone, Default)]
pub struct WorkerTable {
    groups: imbl::OrdMap<Rank, Arc<Group>>,
    /// The dp ranks each engine owns.
    owners: imbl::HashMap<Arc<str>, imbl::OrdSet<Rank>>,
    totals: Totals,
}

/// What the table reports without a pass over its groups, kept with every change.
#[derive(Debug, Clone, Default)]
struct Totals {
    /// Registered worker slots.
    workers: usize,
    /// How many groups have each number of tp ranks (groups with none are not counted).
    tp_sizes: BTreeMap<usize, usize>,
}

impl Totals {
    /// Accounts for a group going from `before` to `after`, each `(workers, tp ranks)`.
    fn update(&mut self, before: (usize, usize), after: (usize, usize)) {
        self.workers = self.workers + after.0 - before.0;
        if before.1 == after.1 {
            return;
        }
        if let Some(count) = self.tp_sizes.get_mut(&before.1) {
            *count -= 1;
            if *count == 0 {
                self.tp_sizes.remove(&before.1);
            }
        }
        if after.1 > 0 {
            *self.tp_sizes.entry(after.1).or_default() += 1;
        }
    }
}

/// The workers of one dp rank.
///
/// Its maps are persistent too: the table readers are shown shares its groups with the one
/// the writer changes, so the first change to a group after each publication copies it, and
/// that copy must not cost a group of a thousand ranks a thousand allocations.
#[derive(Debug, Clone, Default)]
pub struct Group {
    engine_id: Option<Arc<str>>,
    /// Keyed by (cp, tp, pp); each worker shared, so copying a node of the map copies
    /// pointers, not addresses.
    workers: imbl::OrdMap<(Rank, Rank, Rank), Arc<Worker>>,
    /// How many workers each tp rank has (its length is the group's tp rank count), kept with
    /// every change of the group.
    tp_counts: imbl::OrdMap<Rank, usize>,
    /// The highest incarnation of `workers`, kept with every change of the group.
    incarnation: u64,
    /// When a rank last joined or left the group (its address changing is no change of shape;
    /// loading the table from the store is one), on this process's clock.
    reshaped: Option<Instant>,
}

/// One slot's registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Worker {
    pub(super) addr: String,
    pub(super) lease: Option<Lease>,
    pub(super) incarnation: u64,
    pub(super) meta: Arc<EngineMeta>,
    pub(super) extra: Arc<Extra>,
    pub(super) draining: bool,
}

impl Group {
    /// The engine that owns the dp rank (none for workers registered without an engine id).
    pub fn engine_id(&self) -> Option<&str> {
        self.engine_id.as_deref()
    }

    /// The same id, shared (for keys that outlive a borrow of the table).
    pub fn shared_engine_id(&self) -> Option<&Arc<str>> {
        self.engine_id.as_ref()
    }

    /// `(tp rank, pp rank, address)` of every worker at cp rank 0 (all of vLLM's), in rank
    /// order.
    pub fn workers(&self) -> impl Iterator<Item = (Rank, Rank, &str)> {
        self.workers
            .range((0, 0, 0)..=(0, Rank::MAX, Rank::MAX))
            .map(|((_, tp, pp), worker)| (*tp, *pp, worker.addr.as_str()))
    }

    /// The group's tp and pp sizes when its ranks at cp rank 0 (vLLM's) form a whole grid:
    /// tp ranks 0..N-1, each with pp ranks 0..M-1; none when a rank is missing from it.
    pub fn grid(&self) -> Option<(Rank, Rank)> {
        let (mut tp_size, mut pp_size) = (0, None);
        let mut next: (Rank, Rank) = (0, 0);
        for (tp, pp, _) in self.workers() {
            if (tp, pp) == next {
                next.1 += 1;
            } else if (tp, pp) == (next.0 + 1, 0) && pp_size.get_or_insert(next.1) == &next.1 {
                next = (tp, 1);
            } else {
                return None;
            }
            tp_size = tp + 1;
        }
        let pp_size = *pp_size.get_or_insert(next.1);
        (tp_size > 0 && next.1 == pp_size).then_some((tp_size, pp_size))
    }

    /// When a rank last joined or left the group, or the table was loaded from the store.
    pub fn reshaped(&self) -> Option<Instant> {
        self.reshaped
    }

    /// How many workers the group has.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether the group has no worker (never true of a group in a table: an emptied dp rank
    /// is freed).
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Every worker of this group (dp rank `dp`) as a record, in (cp, tp, pp) order.
    pub fn rows(&self, dp: Rank) -> impl Iterator<Item = WorkerRecord> + '_ {
        self.records(dp)
    }

    /// The worker at `slot` (its dp rank is this group's).
    pub(super) fn worker(&self, slot: Slot) -> Option<&Worker> {
        self.workers.get(&(slot.cp, slot.tp, slot.pp)).map(|w| &**w)
    }

    /// Adds or replaces the worker at `key`; true when the group's incarnation must be
    /// recomputed (a replaced worker held it).
    fn put(&mut self, key: (Rank, Rank, Rank), worker: Worker) -> bool {
        let incarnation = worker.incarnation;
        let replaced = self.workers.insert(key, Arc::new(worker));
        if replaced.is_none() {
            *self.tp_counts.entry(key.1).or_default() += 1;
        }
        let stale = replaced.is_some_and(|old| old.incarnation == self.incarnation);
        self.incarnation = self.incarnation.max(incarnation);
        stale && incarnation < self.incarnation
    }

    /// Removes the worker at `key`; true when the group's incarnation must be recomputed (the
    /// removed worker held it).
    fn remove(&mut self, key: (Rank, Rank, Rank)) -> bool {
        let Some(old) = self.workers.remove(&key) else {
            return false;
        };
        if let Some(count) = self.tp_counts.get_mut(&key.1) {
            *count -= 1;
            if *count == 0 {
                self.tp_counts.remove(&key.1);
            }
        }
        old.incarnation == self.incarnation
    }

    /// `(workers, tp ranks)`, what [`Totals`] counts of a group.
    fn size(&self) -> (usize, usize) {
        (self.workers.len(), self.tp_counts.len())
    }

    /// Recomputes the highest incarnation from the workers (after the one holding it left).
    fn recompute_incarnation(&mut self) {
        self.incarnation = self
            .workers
            .values()
            .map(|w| w.incarnation)
            .max()
            .unwrap_or(0);
    }

    /// Every slot of dp rank `dp` with a worker.
    pub(super) fn slots(&self, dp: Rank) -> impl Iterator<Item = Slot> + '_ {
        self.workers.keys().map(move |(cp, tp, pp)| Slot {
            dp,
            cp: *cp,
            tp: *tp,
            pp: *pp,
        })
    }

    /// The group's workers as records.
    fn records(&self, dp: Rank) -> impl Iterator<Item = WorkerRecord> + '_ {
        self.workers
            .iter()
            .map(move |((cp, tp, pp), worker)| WorkerRecord {
                slot: Slot {
                    dp,
                    cp: *cp,
                    tp: *tp,
                    pp: *pp,
                },
                engine_id: self.engine_id.clone(),
                addr: worker.addr.clone(),
                lease: worker.lease,
                incarnation: worker.incarnation,
                meta: worker.meta.clone(),
                extra: worker.extra.clone(),
                draining: worker.draining,
            })
    }
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
        self.totals.workers
    }

    /// How many distinct engines own at least one dp rank.
    pub fn engine_count(&self) -> usize {
        self.owners.len()
    }

    /// The largest number of tp ranks registered in one dp group: P's tp size as far as the
    /// registry can tell without a configured one.
    pub fn observed_tp_size(&self) -> Option<Rank> {
        let (largest, _) = self.totals.tp_sizes.last_key_value()?;
        Some(*largest as Rank)
    }

    /// Whether dp rank `dp` has any workers.
    pub fn has_dp_group(&self, dp: Rank) -> bool {
        self.groups.contains_key(&dp)
    }

    /// The addresses of every pp rank of worker (dp, tp) at cp rank 0, in pp order.
    pub fn addresses(&self, dp: Rank, tp: Rank) -> Vec<String> {
        self.groups
            .get(&dp)
            .map(|g| {
                g.workers
                    .range((0, tp, 0)..=(0, tp, Rank::MAX))
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
            .filter(|(c, t, p)| *c == 0 && *t < tp && *p < pp)
            .count()
    }

    /// Every dp rank with workers, in rank order.
    pub fn groups(&self) -> impl Iterator<Item = (Rank, &Group)> {
        self.groups.iter().map(|(dp, group)| (*dp, &**group))
    }

    /// The group of dp rank `dp`.
    pub(super) fn group(&self, dp: Rank) -> Option<&Group> {
        self.groups.get(&dp).map(|group| &**group)
    }

    /// The dp ranks `engine_id` owns, with their groups, in rank order.
    pub fn engine_groups<'a>(
        &'a self,
        engine_id: &'a str,
    ) -> impl Iterator<Item = (Rank, &'a Group)> + 'a {
        self.owners
            .get(engine_id)
            .into_iter()
            .flatten()
            .filter_map(|dp| Some((*dp, self.group(*dp)?)))
    }

    /// Records that `dp` is owned by `new` instead of `old` in the engines' index.
    fn reindex(&mut self, dp: Rank, old: Option<&Arc<str>>, new: Option<&Arc<str>>) {
        if old == new {
            return;
        }
        if let Some(old) = old {
            if let Some(ranks) = self.owners.get_mut(old) {
                ranks.remove(&dp);
                if ranks.is_empty() {
                    self.owners.remove(old);
                }
            }
        }
        if let Some(new) = new {
            self.owners.entry(new.clone()).or_default().insert(dp);
        }
    }

    /// The incarnation of `engine_id`'s registration, if it has workers. Every worker of an
    /// engine has the same one (a takeover replaces them all, a joining worker takes the
    /// engine's, a claim gives the claimed ones the claimer's), so the first group tells: one
    /// SGLang deployment is one engine of up to thousands of ranks, written one rank at a time.
    pub fn incarnation(&self, engine_id: &str) -> Option<u64> {
        self.engine_groups(engine_id)
            .next()
            .map(|(_, group)| group.incarnation)
    }

    /// Whether an operator marked `engine_id` draining (every worker of an engine carries the
    /// mark; the first tells).
    pub fn draining(&self, engine_id: &str) -> bool {
        self.engine_groups(engine_id)
            .find_map(|(_, group)| group.workers.values().next().map(|w| w.draining))
            .unwrap_or(false)
    }

    /// Applies a change (already made durable). A dp rank whose last worker goes is freed. The
    /// work is a lookup per slot changed, whatever the size of its group or of the table, plus
    /// one pass over a group that the holder of its highest incarnation left.
    pub fn apply(&mut self, change: &WorkerChange) {
        let now = Some(Instant::now());
        let mut stale: Vec<Rank> = Vec::new();
        for slot in &change.remove {
            let Some(group) = self.groups.get_mut(&slot.dp) else {
                continue;
            };
            let group = Arc::make_mut(group);
            let before = group.size();
            if group.remove((slot.cp, slot.tp, slot.pp)) {
                stale.push(slot.dp);
            }
            if group.size() != before {
                group.reshaped = now;
            }
            self.totals.update(before, group.size());
            if group.workers.is_empty() {
                let owner = group.engine_id.clone();
                self.groups.remove(&slot.dp);
                self.reindex(slot.dp, owner.as_ref(), None);
            }
        }
        for record in &change.put {
            let dp = record.slot.dp;
            let group = Arc::make_mut(self.groups.entry(dp).or_default());
            let before = group.size();
            // A worker with an engine id makes its engine the dp rank's owner.
            let moved = match &record.engine_id {
                Some(new) if group.engine_id.as_ref() != Some(new) => {
                    Some(group.engine_id.replace(new.clone()))
                }
                _ => None,
            };
            let worker = Worker {
                addr: record.addr.clone(),
                lease: record.lease,
                incarnation: record.incarnation,
                meta: record.meta.clone(),
                extra: record.extra.clone(),
                draining: record.draining,
            };
            if group.put((record.slot.cp, record.slot.tp, record.slot.pp), worker) {
                stale.push(dp);
            }
            if group.size() != before {
                group.reshaped = now;
            }
            self.totals.update(before, group.size());
            if let Some(old) = moved {
                self.reindex(dp, old.as_ref(), record.engine_id.as_ref());
            }
        }
        stale.sort_unstable();
        stale.dedup();
        for dp in stale {
            if let Some(group) = self.groups.get_mut(&dp) {
                Arc::make_mut(group).recompute_incarnation();
            }
        }
    }

    /// The worker registered at `slot`.
    pub fn get(&self, slot: Slot) -> Option<WorkerRecord> {
        let group = self.groups.get(&slot.dp)?;
        let worker = group.worker(slot)?;
        Some(WorkerRecord {
            slot,
            engine_id: group.engine_id.clone(),
            addr: worker.addr.clone(),
            lease: worker.lease,
            incarnation: worker.incarnation,
            meta: worker.meta.clone(),
            extra: worker.extra.clone(),
            draining: worker.draining,
        })
    }

    /// Every registered worker, in (dp, tp, pp) order.
    pub fn records(&self) -> impl Iterator<Item = WorkerRecord> + '_ {
        self.groups
            .iter()
            .flat_map(|(dp, group)| group.records(*dp))
    }

    /// True when some worker lives by lease `id`.
    pub fn has_lease(&self, id: LeaseId) -> bool {
        self.groups
            .values()
            .flat_map(|g| g.workers.values())
            .any(|w| w.lease.is_some_and(|l| l.id == id))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn worker(dp: Rank, tp: Rank, incarnation: u64) -> WorkerRecord {
        WorkerRecord {
            slot: Slot {
                dp,
                cp: 0,
                tp,
                pp: 0,
            },
            engine_id: Some(Arc::from(format!("e{dp}").as_str())),
            addr: format!("tcp://h:{tp}"),
            lease: None,
            incarnation,
            meta: Arc::default(),
            extra: Arc::default(),
            draining: false,
        }
    }

    /// What the kept counts must equal: the group's workers counted again.
    fn recounted(table: &WorkerTable, dp: Rank) -> (usize, u64) {
        let group = table.group(dp).expect("the group exists");
        let tp_ranks: BTreeSet<Rank> = group.workers.keys().map(|(_, tp, _)| *tp).collect();
        let incarnation = group.workers.values().map(|w| w.incarnation).max();
        (tp_ranks.len(), incarnation.expect("a group has workers"))
    }

    /// What the kept totals must equal: the workers and the largest tp rank count, by a scan.
    fn totals_by_scan(table: &WorkerTable) -> (usize, Option<Rank>) {
        let workers = table.records().count();
        let largest = table.groups().map(|(_, g)| g.tp_counts.len() as Rank).max();
        (workers, largest)
    }

    fn kept(table: &WorkerTable, dp: Rank) -> (usize, u64) {
        let group = table.group(dp).expect("the group exists");
        (group.tp_counts.len(), group.incarnation)
    }

    #[test]
    fn tp_ranks_and_incarnation_are_kept_through_puts_replacements_and_removals() {
        let mut table = WorkerTable::default();
        let steps: Vec<WorkerChange> = vec![
            // Four tp ranks, the last with a newer incarnation.
            WorkerChange {
                remove: Vec::new(),
                put: vec![
                    worker(0, 0, 1),
                    worker(0, 1, 1),
                    worker(0, 2, 1),
                    worker(0, 3, 2),
                ],
            },
            // The newest worker replaced by an older incarnation (a stale write).
            WorkerChange {
                remove: Vec::new(),
                put: vec![worker(0, 3, 1)],
            },
            // A replacement at a tp rank already counted.
            WorkerChange {
                remove: Vec::new(),
                put: vec![worker(0, 1, 5)],
            },
            // The holder of the highest incarnation leaves, then a tp rank does.
            WorkerChange {
                remove: vec![worker(0, 1, 5).slot],
                put: Vec::new(),
            },
            WorkerChange {
                remove: vec![worker(0, 2, 1).slot, worker(0, 9, 1).slot],
                put: Vec::new(),
            },
        ];
        for change in &steps {
            table.apply(change);
            assert_eq!(kept(&table, 0), recounted(&table, 0), "after {change:?}");
            let totals = (table.worker_count(), table.observed_tp_size());
            assert_eq!(totals, totals_by_scan(&table), "after {change:?}");
        }
        assert_eq!(kept(&table, 0), (2, 1));
        assert_eq!(table.observed_tp_size(), Some(2));
        assert_eq!(table.incarnation("e0"), Some(1));
        table.apply(&WorkerChange {
            remove: vec![worker(0, 0, 1).slot, worker(0, 3, 1).slot],
            put: Vec::new(),
        });
        assert!(!table.has_dp_group(0), "an emptied dp rank is freed");
        assert_eq!(table.observed_tp_size(), None);
    }

    /// What the engines' index must equal: every group's owner, found by a scan.
    fn scanned(table: &WorkerTable) -> BTreeMap<String, Vec<Rank>> {
        let mut owners: BTreeMap<String, Vec<Rank>> = BTreeMap::new();
        for (dp, group) in table.groups() {
            if let Some(engine) = group.engine_id() {
                owners.entry(engine.to_owned()).or_default().push(dp);
            }
        }
        owners
    }

    fn indexed(table: &WorkerTable) -> BTreeMap<String, Vec<Rank>> {
        table
            .owners
            .keys()
            .map(|engine| {
                let ranks = table.engine_groups(engine).map(|(dp, _)| dp).collect();
                (engine.to_string(), ranks)
            })
            .collect()
    }

    fn owned_by(engine: Option<&str>, dp: Rank, tp: Rank) -> WorkerRecord {
        WorkerRecord {
            engine_id: engine.map(Arc::from),
            ..worker(dp, tp, 1)
        }
    }

    #[test]
    fn the_engines_index_follows_owners_through_every_kind_of_change() {
        let mut table = WorkerTable::default();
        let steps: Vec<WorkerChange> = vec![
            // Two engines, and a worker without an engine id.
            WorkerChange {
                remove: Vec::new(),
                put: vec![
                    owned_by(Some("A"), 0, 0),
                    owned_by(Some("A"), 1, 0),
                    owned_by(Some("B"), 2, 0),
                    owned_by(None, 3, 0),
                ],
            },
            // B takes dp rank 1 over from A; A's worker at dp 0 is joined by an unowned one
            // (which keeps the rank's owner); dp rank 3 is claimed by A.
            WorkerChange {
                remove: vec![owned_by(None, 1, 0).slot],
                put: vec![
                    owned_by(Some("B"), 1, 1),
                    owned_by(None, 0, 1),
                    owned_by(Some("A"), 3, 1),
                ],
            },
            // B's ranks empty out one slot at a time.
            WorkerChange {
                remove: vec![owned_by(None, 1, 1).slot],
                put: Vec::new(),
            },
            WorkerChange {
                remove: vec![owned_by(None, 2, 0).slot],
                put: Vec::new(),
            },
        ];
        for change in &steps {
            table.apply(change);
            assert_eq!(indexed(&table), scanned(&table), "after {change:?}");
            let totals = (table.worker_count(), table.observed_tp_size());
            assert_eq!(totals, totals_by_scan(&table), "after {change:?}");
            assert_eq!(table.engine_count(), scanned(&table).len());
        }
        assert_eq!(
            indexed(&table),
            BTreeMap::from([("A".to_owned(), vec![0, 3])])
        );
        assert_eq!(table.engine_groups("B").count(), 0);
    }
}
