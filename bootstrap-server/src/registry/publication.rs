//! Which dp groups a decode may be shown. vLLM's D asks `GET /query` once per unknown engine,
//! keeps the first 200 answer for its life and takes P's TP size from the tp ranks listed, so an
//! answer given while P's ranks are still registering (one by one, with no TP size on the wire)
//! leaves that D waiting for ranks it will never ask about again. A group is published once its
//! ranks are complete by evidence: with a configured tp and pp size, exactly those ranks; without
//! one, a whole grid (tp ranks 0..N-1, each with pp ranks 0..M-1) that no rank joined or left for
//! the settle window. A group that is not published is pending; `GET /query` answers 503 for it
//! (a stock D caches no error), and pd-proxy routes to it only once `/query` lists it.

use std::time::{Duration, Instant};

use super::config::ExpectedTopology;
use super::workers::Group;

/// Why a group is not published yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pending {
    /// Its workers so far.
    pub ranks: usize,
    /// When its ranks form a whole grid, how long until the settle window has passed without a
    /// change; none while ranks are missing from it.
    pub settles_in: Option<Duration>,
}

/// Whether `group` may be shown to a decode at `now`: `Ok` when its ranks are complete
/// (against `expected` where configured, else a whole grid unchanged for `settle`).
pub fn publication(
    group: &Group,
    expected: Option<ExpectedTopology>,
    settle: Duration,
    now: Instant,
) -> Result<(), Pending> {
    let ranks = group.len();
    let missing = Pending {
        ranks,
        settles_in: None,
    };
    let grid = group.grid().ok_or(missing)?;
    if let Some(expected) = expected {
        return match grid == (expected.tp_size, expected.pp_size) {
            true => Ok(()),
            false => Err(missing),
        };
    }
    let settled = group.reshaped().map_or(now, |at| at + settle);
    match settled.checked_duration_since(now) {
        Some(left) if !left.is_zero() => Err(Pending {
            ranks,
            settles_in: Some(left),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use pd_protocol::Rank;

    use super::*;
    use crate::registry::model::{Slot, WorkerChange, WorkerRecord};
    use crate::registry::WorkerTable;

    fn worker(tp: Rank, pp: Rank) -> WorkerRecord {
        WorkerRecord {
            slot: Slot {
                dp: 0,
                cp: 0,
                tp,
                pp,
            },
            engine_id: Some(Arc::from("e")),
            addr: format!("tcp://h:{tp}{pp}"),
            lease: None,
            incarnation: 1,
            meta: Arc::default(),
            extra: Arc::default(),
            draining: false,
        }
    }

    fn table(ranks: &[(Rank, Rank)]) -> WorkerTable {
        let mut table = WorkerTable::default();
        table.apply(&WorkerChange {
            remove: Vec::new(),
            put: ranks.iter().map(|(tp, pp)| worker(*tp, *pp)).collect(),
        });
        table
    }

    fn grid(ranks: &[(Rank, Rank)]) -> Option<(Rank, Rank)> {
        table(ranks)
            .groups()
            .next()
            .and_then(|(_, group)| group.grid())
    }

    #[test]
    fn only_whole_grids_of_ranks_count() {
        assert_eq!(grid(&[(0, 0)]), Some((1, 1)));
        assert_eq!(grid(&[(0, 0), (1, 0), (2, 0), (3, 0)]), Some((4, 1)));
        assert_eq!(grid(&[(0, 0), (0, 1), (1, 0), (1, 1)]), Some((2, 2)));
        for holes in [
            &[(1, 0)][..],
            &[(0, 0), (2, 0)],
            &[(0, 1)],
            &[(0, 0), (0, 1), (1, 0)],
            &[(0, 0), (1, 0), (1, 1)],
            &[(0, 0), (0, 2)],
        ] {
            assert_eq!(grid(holes), None, "{holes:?}");
        }
    }

    #[test]
    fn a_group_is_published_once_settled_or_exactly_as_configured() {
        let settle = Duration::from_secs(2);
        let two = table(&[(0, 0), (1, 0)]);
        let (_, group) = two.groups().next().unwrap();
        let at = group.reshaped().unwrap();
        let pending = publication(group, None, settle, at + Duration::from_millis(500));
        assert_eq!(
            pending,
            Err(Pending {
                ranks: 2,
                settles_in: Some(Duration::from_millis(1500))
            })
        );
        assert_eq!(publication(group, None, settle, at + settle), Ok(()));
        // A configured size makes it exact, at once, and holds back a grid of another size.
        let expected = |tp_size| ExpectedTopology {
            dp_size: 1,
            tp_size,
            pp_size: 1,
        };
        assert_eq!(publication(group, Some(expected(2)), settle, at), Ok(()));
        let short = publication(group, Some(expected(4)), settle, at + settle);
        assert_eq!(
            short,
            Err(Pending {
                ranks: 2,
                settles_in: None
            })
        );
        // Ranks missing from the grid are never published, however long they wait.
        let holed = table(&[(0, 0), (2, 0)]);
        let (_, group) = holed.groups().next().unwrap();
        let later = group.reshaped().unwrap() + Duration::from_secs(3600);
        assert_eq!(
            publication(group, None, settle, later)
                .unwrap_err()
                .settles_in,
            None
        );
    }
}
