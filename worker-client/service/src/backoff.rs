//! The pauses between retries (the proxy's discovery, the worker client's calls, watch and
//! lease keep-alives): exponential, with jitter that never takes a pause past its cap.
//!
//! backon's jitter adds up to one more step on top of each pause, so a 5 s cap gave pauses of up
//! to 10 s; here each pause is drawn between half and all of its step (`min`, `2 min`, ...,
//! `max`), so every pause is at most `max`.

use std::hash::{BuildHasher, RandomState};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// Pauses doubling from `min` to `max`, each drawn in the upper half of its step; as an
/// iterator (endless) it is a backon backoff too.
#[derive(Debug)]
pub struct Backoff {
    builder: ExponentialBuilder,
    steps: ExponentialBackoff,
    /// Keyed once from the OS; hashing a counter with it draws the jitter.
    key: RandomState,
    draws: u64,
}

impl Backoff {
    /// Pauses from `min` (at most `max`) doubling up to `max`.
    pub fn new(min: Duration, max: Duration) -> Self {
        let builder = ExponentialBuilder::default()
            .with_min_delay(min.min(max))
            .with_max_delay(max)
            .with_factor(2.0)
            .without_max_times();
        Backoff {
            steps: builder.build(),
            builder,
            key: RandomState::new(),
            draws: 0,
        }
    }

    /// The next pause: between half and all of the next step.
    pub fn next_pause(&mut self) -> Duration {
        let step = self.steps.next().unwrap_or_default();
        self.draws += 1;
        // The top 53 bits of a hash, as a fraction in [0, 1).
        let unit = (self.key.hash_one(self.draws) >> 11) as f64 / (1u64 << 53) as f64;
        step.mul_f64(0.5 + unit / 2.0)
    }

    /// Starts again from the first step.
    pub fn reset(&mut self) {
        self.steps = self.builder.build();
    }
}

impl Iterator for Backoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.next_pause())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_and_never_pass_the_cap() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(5));
        let mut backoff = Backoff::new(min, max);
        let first: Vec<Duration> = (0..4).map(|_| backoff.next_pause()).collect();
        for (n, pause) in first.iter().enumerate() {
            let step = min * 2u32.pow(n as u32);
            assert!(*pause >= step / 2 && *pause <= step, "pause {n}: {pause:?}");
        }
        // 1.6 s, 3.2 s, then the cap.
        let later: Vec<Duration> = (0..1000).map(|_| backoff.next_pause()).collect();
        assert!(later.iter().all(|pause| *pause <= max), "{later:?}");
        assert!(later[2..].iter().all(|pause| *pause >= max / 2));
        assert!(later.iter().any(|pause| *pause > max * 9 / 10));
        backoff.reset();
        assert!(backoff.next_pause() <= min);
        // A cap below the first step is still the cap.
        let mut tight = Backoff::new(Duration::from_secs(1), Duration::from_millis(50));
        assert!((0..10).all(|_| tight.next_pause() <= Duration::from_millis(50)));
    }
}
