//! A token bucket: `capacity` tokens, refilled at `rate` per second, taken whole or not at all.

use std::time::{Duration, Instant};

/// One bucket.
#[derive(Debug, Clone)]
pub struct Bucket {
    capacity: f64,
    rate: f64,
    tokens: f64,
    at: Instant,
}

/// Why a take did not happen: when enough tokens will be there, and what is there now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Short {
    /// How long until the tokens asked for are there (none: never, the ask is over capacity).
    pub wait: Option<Duration>,
}

impl Bucket {
    /// A full bucket of `capacity` tokens refilled at `rate` per second.
    pub fn new(capacity: f64, rate: f64, now: Instant) -> Self {
        Bucket {
            capacity,
            rate,
            tokens: capacity,
            at: now,
        }
    }

    /// The bucket's size.
    pub fn capacity(&self) -> f64 {
        self.capacity
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate).min(self.capacity);
        self.at = now;
    }

    /// Whether `cost` tokens are there now (nothing taken).
    pub fn check(&mut self, cost: f64, now: Instant) -> Result<(), Short> {
        self.refill(now);
        if cost <= self.tokens {
            return Ok(());
        }
        let wait = (cost <= self.capacity && self.rate > 0.0)
            .then(|| seconds((cost - self.tokens) / self.rate));
        Err(Short { wait })
    }

    /// Takes `cost` tokens (call after [`Bucket::check`] said they are there).
    pub fn take(&mut self, cost: f64) {
        self.tokens -= cost;
    }

    /// The tokens there now.
    pub fn remaining(&mut self, now: Instant) -> f64 {
        self.refill(now);
        self.tokens.max(0.0)
    }

    /// How long until the bucket is full again.
    pub fn until_full(&mut self, now: Instant) -> Duration {
        self.refill(now);
        match self.rate > 0.0 {
            true => seconds((self.capacity - self.tokens).max(0.0) / self.rate),
            false => Duration::ZERO,
        }
    }

    /// The bucket with another size and rate that keeps what was used of this one (a tenant
    /// whose limits change keeps what it has spent).
    pub fn resized(&mut self, capacity: f64, rate: f64, now: Instant) -> Bucket {
        let used = self.capacity - self.remaining(now);
        Bucket {
            capacity,
            rate,
            tokens: (capacity - used).clamp(0.0, capacity),
            at: now,
        }
    }
}

/// `secs` as a duration, however large (a tiny rate makes a wait of ages).
fn seconds(secs: f64) -> Duration {
    Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_refill_and_say_how_long_to_wait() {
        let start = Instant::now();
        let mut bucket = Bucket::new(10.0, 5.0, start);
        assert!(bucket.check(10.0, start).is_ok());
        bucket.take(10.0);
        let short = bucket.check(5.0, start).unwrap_err();
        assert_eq!(short.wait, Some(Duration::from_secs(1)));
        let later = start + Duration::from_millis(1000);
        assert!(bucket.check(5.0, later).is_ok());
        assert_eq!(bucket.until_full(later), Duration::from_secs(1));
        // Never more than the capacity, and an ask over it never fits.
        let much_later = start + Duration::from_secs(3600);
        assert_eq!(bucket.remaining(much_later), 10.0);
        assert_eq!(bucket.check(11.0, much_later).unwrap_err().wait, None);
        // A rate so small the wait would overflow a duration: the longest one, no panic.
        let mut slow = Bucket::new(1.0, 1e-300, start);
        slow.take(1.0);
        assert_eq!(
            slow.check(1.0, start).unwrap_err().wait,
            Some(Duration::MAX)
        );
        assert_eq!(slow.until_full(start), Duration::MAX);
    }
}
