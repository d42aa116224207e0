//! Choosing a backend: round robin, or least loaded by power of two random choices.
//!
//! Both skip candidates that are not usable (unhealthy, or the decode that just failed); when
//! none is usable they choose nothing and the caller answers 503.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::config::Policy;

/// One policy and its counters; one per kind of choice (pairs, decodes).
pub struct Picker {
    policy: Policy,
    next: AtomicUsize,
    seed: AtomicU64,
}

impl Picker {
    /// A picker following `policy`.
    pub fn new(policy: Policy) -> Self {
        Picker {
            policy,
            next: AtomicUsize::new(0),
            seed: AtomicU64::new(0x853c_49e6_748f_ea9b),
        }
    }

    /// Chooses one of `items` for which `usable` holds; `load` is its outstanding requests.
    pub fn pick<'a, T>(
        &self,
        items: &'a [T],
        usable: impl Fn(&T) -> bool,
        load: impl Fn(&T) -> usize,
    ) -> Option<&'a T> {
        match self.policy {
            Policy::RoundRobin => self.round_robin(items, usable),
            Policy::LeastLoaded => self.power_of_two(items, usable, load),
        }
    }

    fn round_robin<'a, T>(&self, items: &'a [T], usable: impl Fn(&T) -> bool) -> Option<&'a T> {
        let n = items.len();
        if n == 0 {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|offset| &items[(start + offset) % n])
            .find(|item| usable(item))
    }

    fn power_of_two<'a, T>(
        &self,
        items: &'a [T],
        usable: impl Fn(&T) -> bool,
        load: impl Fn(&T) -> usize,
    ) -> Option<&'a T> {
        let n = items.len();
        if n == 0 {
            return None;
        }
        if n == 1 {
            return items.first().filter(|item| usable(item));
        }
        let random = self.random();
        let first = (random % n as u64) as usize;
        // A second index distinct from the first.
        let second = (first + 1 + ((random >> 32) % (n as u64 - 1)) as usize) % n;
        let (a, b) = (&items[first], &items[second]);
        match (usable(a), usable(b)) {
            (true, true) => Some(if load(b) < load(a) { b } else { a }),
            (true, false) => Some(a),
            (false, true) => Some(b),
            // Both samples are out: the least loaded usable one, if any.
            (false, false) => items
                .iter()
                .filter(|item| usable(item))
                .min_by_key(|item| load(item)),
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_robin_takes_each_in_turn_and_skips_unusable() {
        let picker = Picker::new(Policy::RoundRobin);
        let items = [0, 1, 2];
        let picks: Vec<i32> = (0..6)
            .map(|_| *picker.pick(&items, |_| true, |_| 0).unwrap())
            .collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        let mut counts = [0; 3];
        for _ in 0..30 {
            counts[*picker.pick(&items, |&i| i != 1, |_| 0).unwrap() as usize] += 1;
        }
        assert_eq!(counts[1], 0);
        assert!(counts[0] >= 10 && counts[2] >= 10, "{counts:?}");
        assert!(picker.pick(&items, |_| false, |_| 0).is_none());
        assert!(picker.pick::<i32>(&[], |_| true, |_| 0).is_none());
    }

    #[test]
    fn least_loaded_avoids_the_busiest_and_spreads_ties() {
        let picker = Picker::new(Policy::LeastLoaded);
        let items = [0usize, 1, 2, 3];
        let loads = [100, 0, 0, 0];
        let mut counts = [0; 4];
        for _ in 0..3000 {
            counts[*picker.pick(&items, |_| true, |&i| loads[i]).unwrap()] += 1;
        }
        // Two distinct samples: the busiest loses every comparison.
        assert_eq!(counts[0], 0, "{counts:?}");
        for count in &counts[1..] {
            assert!((700..=1300).contains(count), "{counts:?}");
        }
    }

    #[test]
    fn least_loaded_follows_load_and_health() {
        let picker = Picker::new(Policy::LeastLoaded);
        let items = [0usize, 1];
        for _ in 0..100 {
            assert_eq!(*picker.pick(&items, |_| true, |&i| [5, 3][i]).unwrap(), 1);
            assert_eq!(
                *picker.pick(&items, |&i| i == 0, |&i| [5, 3][i]).unwrap(),
                0
            );
        }
        let three = [0usize, 1, 2];
        for _ in 0..100 {
            assert_eq!(*picker.pick(&three, |&i| i == 2, |_| 0).unwrap(), 2);
        }
        assert!(picker.pick(&three, |_| false, |_| 0).is_none());
        assert_eq!(*picker.pick(&[7usize], |_| true, |_| 9).unwrap(), 7);
    }
}
