//! [`View`]: an immutable snapshot of the worker table, kept until the next change, with what
//! the wire modules render from it.

use std::any::{Any, TypeId};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::{Duration, Instant};

use pd_protocol::Rank;

use super::model::Readiness;
use super::publication::{publication, Pending};
use super::{ExpectedTopology, Group, WorkerTable};

/// The worker table as of one change, its readiness, and the renderings made from it.
///
/// Making one costs the same whatever the table's size (the table is a persistent map), so a
/// read after every write stays cheap; what needs a pass over the table is made on first use.
/// A wire module that answers reads from the table (vLLM's `GET /query`) renders once per
/// change with [`View::rendered`] and hands out the same bytes until the table changes.
pub struct View {
    table: WorkerTable,
    expected: Option<ExpectedTopology>,
    settle: Duration,
    readiness: OnceLock<Readiness>,
    renderings: RwLock<Vec<(TypeId, Arc<dyn Any + Send + Sync>)>>,
}

impl View {
    /// A snapshot of `table`, complete or not against `expected`, its groups published after
    /// `settle` without one.
    pub(super) fn new(
        table: &WorkerTable,
        expected: Option<ExpectedTopology>,
        settle: Duration,
    ) -> Self {
        View {
            table: table.clone(),
            expected,
            settle,
            readiness: OnceLock::new(),
            renderings: RwLock::new(Vec::new()),
        }
    }

    /// The workers.
    pub fn table(&self) -> &WorkerTable {
        &self.table
    }

    /// How complete the topology is (against an expected topology, counted on first use).
    pub fn readiness(&self) -> Readiness {
        *self.readiness.get_or_init(|| {
            let registered = self.table.worker_count();
            match self.expected {
                Some(expected) => Readiness {
                    registered,
                    expected: Some(expected.worker_count()),
                    missing: expected
                        .worker_count()
                        .saturating_sub(self.table.count_within(
                            expected.dp_size,
                            expected.tp_size,
                            expected.pp_size,
                        )),
                },
                None => Readiness {
                    registered,
                    expected: None,
                    missing: 0,
                },
            }
        })
    }

    /// Whether `group` (of this view's table) may be shown to a decode at `now`
    /// ([`super::publication`]).
    pub fn publication(&self, group: &Group, now: Instant) -> Result<(), Pending> {
        publication(group, self.expected, self.settle, now)
    }

    /// The largest number of tp ranks registered in one dp group: P's tp size as far as the
    /// table tells without a configured one.
    pub fn observed_tp_size(&self) -> Option<Rank> {
        self.table.observed_tp_size()
    }

    /// Engines owning at least one dp rank.
    pub fn engines(&self) -> usize {
        self.table.engine_count()
    }

    /// The rendering of type `T` made from this snapshot: made by `render` on first use, the
    /// same afterwards (one rendering per type).
    pub fn rendered<T: Any + Send + Sync>(&self, render: impl FnOnce(&WorkerTable) -> T) -> Arc<T> {
        let find = |renderings: &[(TypeId, Arc<dyn Any + Send + Sync>)]| {
            renderings
                .iter()
                .find(|(id, _)| *id == TypeId::of::<T>())
                .and_then(|(_, value)| value.clone().downcast::<T>().ok())
        };
        let renderings = self.renderings.read().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = find(&renderings) {
            return found;
        }
        drop(renderings);
        let mut renderings = self.renderings.write().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = find(&renderings) {
            return found;
        }
        let made = Arc::new(render(&self.table));
        renderings.push((TypeId::of::<T>(), made.clone()));
        made
    }
}
