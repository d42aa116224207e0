//! Least loaded, by the power of two random choices: of two random candidates, the one with fewer
//! requests outstanding through this proxy.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{Candidates, Policy, RequestInfo};

/// Power of two random choices over the outstanding requests.
#[derive(Debug)]
pub struct LeastLoaded {
    seed: AtomicU64,
}

impl Default for LeastLoaded {
    fn default() -> Self {
        LeastLoaded {
            seed: AtomicU64::new(0x853c_49e6_748f_ea9b),
        }
    }
}

impl LeastLoaded {
    /// splitmix64 over a shared counter: cheap, lock-free, good enough to spread load.
    fn random(&self) -> u64 {
        let mut z = self
            .seed
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
            .wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

impl Policy for LeastLoaded {
    fn pick(&self, candidates: &dyn Candidates, _request: &RequestInfo<'_>) -> Option<usize> {
        let n = candidates.len();
        if n == 0 {
            return None;
        }
        if n == 1 {
            return candidates.usable(0).then_some(0);
        }
        let random = self.random();
        let a = (random % n as u64) as usize;
        // A second index distinct from the first.
        let b = (a + 1 + ((random >> 32) % (n as u64 - 1)) as usize) % n;
        match (candidates.usable(a), candidates.usable(b)) {
            (true, true) => Some(if candidates.load(b) < candidates.load(a) {
                b
            } else {
                a
            }),
            (true, false) => Some(a),
            (false, true) => Some(b),
            // Both samples are out: the least loaded usable one, if any.
            (false, false) => (0..n)
                .filter(|i| candidates.usable(*i))
                .min_by_key(|i| candidates.load(*i)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::fixed;
    use super::*;

    #[test]
    fn avoids_the_busiest_and_spreads_ties() {
        let policy = LeastLoaded::default();
        let request = RequestInfo::empty();
        let candidates = fixed(4, |_| true, &[100, 0, 0, 0]);
        let mut counts = [0; 4];
        for _ in 0..3000 {
            counts[policy.pick(&candidates, &request).unwrap()] += 1;
        }
        // Two distinct samples: the busiest loses every comparison.
        assert_eq!(counts[0], 0, "{counts:?}");
        for count in &counts[1..] {
            assert!((700..=1300).contains(count), "{counts:?}");
        }
    }

    #[test]
    fn follows_load_and_health() {
        let policy = LeastLoaded::default();
        let request = RequestInfo::empty();
        for _ in 0..100 {
            assert_eq!(policy.pick(&fixed(2, |_| true, &[5, 3]), &request), Some(1));
            assert_eq!(
                policy.pick(&fixed(2, |i| i == 0, &[5, 3]), &request),
                Some(0)
            );
        }
        for _ in 0..100 {
            assert_eq!(policy.pick(&fixed(3, |i| i == 2, &[]), &request), Some(2));
        }
        assert!(policy.pick(&fixed(3, |_| false, &[]), &request).is_none());
        assert_eq!(policy.pick(&fixed(1, |_| true, &[9]), &request), Some(0));
    }
}
