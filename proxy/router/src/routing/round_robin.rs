//! Round robin: each candidate in turn, skipping those not usable.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Candidates, Policy, RequestInfo};

/// Takes the candidates in turn.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn pick(&self, candidates: &dyn Candidates, _request: &RequestInfo<'_>) -> Option<usize> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|offset| (start + offset) % n)
            .find(|i| candidates.usable(*i))
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::fixed;
    use super::*;

    #[test]
    fn takes_each_in_turn_and_skips_unusable() {
        let policy = RoundRobin::default();
        let request = RequestInfo::empty();
        let all = fixed(3, |_| true, &[]);
        let picks: Vec<usize> = (0..6)
            .map(|_| policy.pick(&all, &request).unwrap())
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        let mut counts = [0; 3];
        let without_1 = fixed(3, |i| i != 1, &[]);
        for _ in 0..30 {
            counts[policy.pick(&without_1, &request).unwrap()] += 1;
        }
        assert_eq!(counts[1], 0);
        assert!(counts[0] >= 10 && counts[2] >= 10, "{counts:?}");
        assert!(policy.pick(&fixed(3, |_| false, &[]), &request).is_none());
        assert!(policy.pick(&fixed(0, |_| true, &[]), &request).is_none());
    }
}
