//! Cache aware: send a prompt where its prefix was served before, so the engine's prefix cache
//! computes only the rest, unless that would pile load on one backend.
//!
//! Per pick: when the usable candidates' loads are out of balance (they differ by more than
//! the absolute threshold and by more than the relative factor) the least loaded wins. Else the
//! candidate holding the longest prefix of the prompt ([`PrefixIndex`]) wins if that prefix is at
//! least the threshold share of the prompt; else the least loaded. Either way the chosen one is
//! recorded as holding the prompt's blocks.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::prefix_index::{prefix_blocks, PrefixIndex, BLOCK_BYTES};
use super::settings::CacheAwareConfig;
use super::{Candidates, Policy, RequestInfo};

/// The cache-aware policy.
#[derive(Debug)]
pub struct CacheAware {
    config: CacheAwareConfig,
    index: PrefixIndex,
    /// Where ties between equally loaded candidates start, so they spread.
    turn: AtomicUsize,
}

/// A cache-aware pick and why it was made.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CachePick {
    /// The candidate chosen.
    pub index: usize,
    /// The share of the prompt (0 to 1) the chosen candidate already held.
    pub matched: f64,
}

impl CacheAware {
    /// The policy with its thresholds and index capacity.
    pub fn new(config: CacheAwareConfig) -> Self {
        CacheAware {
            index: PrefixIndex::new(config.max_blocks),
            config,
            turn: AtomicUsize::new(0),
        }
    }

    /// The least loaded usable candidate, ties taken in turn.
    fn least_loaded(&self, candidates: &dyn Candidates, usable: &[usize]) -> Option<usize> {
        let min = usable.iter().map(|&i| candidates.load(i)).min()?;
        let tied: Vec<usize> = usable
            .iter()
            .copied()
            .filter(|&i| candidates.load(i) == min)
            .collect();
        Some(tied[self.turn.fetch_add(1, Ordering::Relaxed) % tied.len()])
    }

    fn balanced(&self, candidates: &dyn Candidates, usable: &[usize]) -> bool {
        let loads = usable.iter().map(|&i| candidates.load(i));
        let (min, max) = loads.fold((usize::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        max.saturating_sub(min) <= self.config.balance_abs_threshold
            || (max as f64) <= (min as f64) * self.config.balance_rel_threshold
    }

    /// The pick for `text`, recorded in the index.
    pub fn pick_for(&self, candidates: &dyn Candidates, text: &str) -> Option<CachePick> {
        let usable: Vec<usize> = (0..candidates.len())
            .filter(|&i| candidates.usable(i))
            .collect();
        let blocks = prefix_blocks(text);
        let ids: Vec<u64> = usable.iter().map(|&i| candidates.id(i)).collect();
        let matches = self.index.matches(&blocks, &ids);
        let share = |blocks: usize| {
            if text.is_empty() {
                0.0
            } else {
                (blocks * BLOCK_BYTES) as f64 / text.len() as f64
            }
        };
        let best = (0..usable.len())
            .max_by_key(|&k| (matches[k], std::cmp::Reverse(candidates.load(usable[k]))))?;
        let pick = if self.balanced(candidates, &usable)
            && matches[best] > 0
            && share(matches[best]) >= self.config.threshold
        {
            CachePick {
                index: usable[best],
                matched: share(matches[best]),
            }
        } else {
            let index = self.least_loaded(candidates, &usable)?;
            let k = usable.iter().position(|&i| i == index).unwrap_or(best);
            CachePick {
                index,
                matched: share(matches[k]),
            }
        };
        self.index.insert(&blocks, candidates.id(pick.index));
        Some(pick)
    }

    /// The share of `text` (0 to 1) the best-placed usable candidate holds, without recording
    /// anything.
    pub fn best_match(&self, candidates: &dyn Candidates, text: &str) -> f64 {
        let ids: Vec<u64> = (0..candidates.len())
            .filter(|&i| candidates.usable(i))
            .map(|i| candidates.id(i))
            .collect();
        let blocks = prefix_blocks(text);
        let best = self.index.matches(&blocks, &ids).into_iter().max();
        match best {
            Some(blocks) if !text.is_empty() => (blocks * BLOCK_BYTES) as f64 / text.len() as f64,
            _ => 0.0,
        }
    }
}

impl Policy for CacheAware {
    fn pick(&self, candidates: &dyn Candidates, request: &RequestInfo<'_>) -> Option<usize> {
        self.pick_for(candidates, request.prompt_text())
            .map(|pick| pick.index)
    }

    fn prefix_match(&self, candidates: &dyn Candidates, request: &RequestInfo<'_>) -> Option<f64> {
        Some(self.best_match(candidates, request.prompt_text()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::fixed;
    use super::*;

    fn policy() -> CacheAware {
        CacheAware::new(CacheAwareConfig {
            threshold: 0.5,
            balance_abs_threshold: 4,
            balance_rel_threshold: 1.5,
            max_blocks: 10_000,
        })
    }

    fn prompt(system: char, turn: usize) -> String {
        format!(
            "{}{}",
            system.to_string().repeat(640),
            "u".repeat(turn * 64)
        )
    }

    #[test]
    fn a_shared_prefix_returns_to_the_backend_that_served_it() {
        let policy = policy();
        let all = fixed(4, |_| true, &[]);
        let first = policy.pick_for(&all, &prompt('a', 1)).unwrap();
        assert_eq!(first.matched, 0.0);
        for turn in 2..6 {
            let next = policy.pick_for(&all, &prompt('a', turn)).unwrap();
            assert_eq!(next.index, first.index);
            assert!(next.matched > 0.5, "{next:?}");
        }
        // Another system prompt matches nothing anywhere.
        assert_eq!(policy.pick_for(&all, &prompt('b', 1)).unwrap().matched, 0.0);
    }

    #[test]
    fn imbalance_and_health_override_the_match() {
        let policy = policy();
        let idle = fixed(2, |_| true, &[0, 0]);
        let home = policy.pick_for(&idle, &prompt('a', 1)).unwrap().index;
        let mut loads = [0; 2];
        loads[home] = 10;
        let unbalanced = fixed(2, |_| true, &loads);
        assert_eq!(
            policy.pick_for(&unbalanced, &prompt('a', 2)).unwrap().index,
            1 - home
        );
        let home_down = fixed(2, |i| i != home, &[]);
        assert_eq!(
            policy.pick_for(&home_down, &prompt('a', 3)).unwrap().index,
            1 - home
        );
        assert!(policy.pick_for(&fixed(2, |_| false, &[]), "x").is_none());
    }

    #[test]
    fn a_small_match_is_not_worth_it() {
        let policy = policy();
        let all = fixed(2, |_| true, &[]);
        let shared = "s".repeat(64);
        let home = policy
            .pick_for(&all, &format!("{shared}{}", "a".repeat(640)))
            .unwrap()
            .index;
        let mut loads = [0; 2];
        loads[home] = 1;
        // One block of 11 in common: below the threshold, the least loaded wins.
        let pick = policy
            .pick_for(
                &fixed(2, |_| true, &loads),
                &format!("{shared}{}", "b".repeat(640)),
            )
            .unwrap();
        assert_eq!(pick.index, 1 - home);
        assert!(policy.best_match(&all, &format!("{shared}{}", "a".repeat(640))) > 0.9);
    }
}
