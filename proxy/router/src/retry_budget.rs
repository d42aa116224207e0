//! The retry budget: retries on another engine (D's retry, a re-send after P's engine
//! changed) are allowed only while they stay a share (`--retry-budget-ratio`) of the requests of
//! the last ten seconds, plus a floor per second (`--retry-budget-floor`) so that a quiet proxy
//! still retries. A sick fleet then sees at most that share of extra traffic, never a storm.
//!
//! A request costs one relaxed atomic add; only a retry takes the lock, over two five-second
//! windows (the previous one counted whole: a sliding window's usual approximation).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::sync::lock;

/// Half the window the budget counts over.
const HALF: Duration = Duration::from_secs(5);

/// Requests and retries per window.
struct Windows {
    /// When the current window began.
    started: Instant,
    /// The request count when it began.
    requests_at_start: u64,
    /// Requests and retries of the previous window.
    previous: (u64, u64),
    /// Retries of the current window.
    retries: u64,
}

/// The retries a router may still make.
pub struct RetryBudget {
    ratio: f64,
    floor: f64,
    requests: AtomicU64,
    windows: Mutex<Windows>,
}

impl RetryBudget {
    /// A budget of `ratio` retries per request plus `floor` per second.
    pub fn new(ratio: f64, floor: f64) -> Self {
        RetryBudget {
            ratio,
            floor,
            requests: AtomicU64::new(0),
            windows: Mutex::new(Windows {
                started: Instant::now(),
                requests_at_start: 0,
                previous: (0, 0),
                retries: 0,
            }),
        }
    }

    /// Counts a request (what the budget is a share of).
    pub fn request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether one retry fits in the budget now; if so it is counted.
    pub fn try_retry(&self) -> bool {
        self.try_retry_at(Instant::now())
    }

    fn try_retry_at(&self, now: Instant) -> bool {
        let mut windows = lock(&self.windows);
        // Read under the lock: a window turned by another retry never starts after it.
        let total = self.requests.load(Ordering::Relaxed);
        let elapsed = now.saturating_duration_since(windows.started);
        if elapsed >= HALF * 2 {
            *windows = Windows {
                started: now,
                requests_at_start: total,
                previous: (0, 0),
                retries: 0,
            };
        } else if elapsed >= HALF {
            let requests = total.saturating_sub(windows.requests_at_start);
            windows.previous = (requests, windows.retries);
            windows.started += HALF;
            windows.requests_at_start = total;
            windows.retries = 0;
        }
        let requests = windows.previous.0 + total.saturating_sub(windows.requests_at_start);
        let allowed = self.ratio * requests as f64 + self.floor * (HALF * 2).as_secs_f64();
        let spent = windows.previous.1 + windows.retries;
        if (spent + 1) as f64 <= allowed {
            windows.retries += 1;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_stay_a_share_of_recent_requests_plus_the_floor() {
        let budget = RetryBudget::new(0.1, 0.5);
        let now = Instant::now();
        // The floor: 0.5 per second over ten seconds.
        let floor = (0..20).filter(|_| budget.try_retry_at(now)).count();
        assert_eq!(floor, 5);
        for _ in 0..100 {
            budget.request();
        }
        // A tenth of a hundred requests more.
        let share = (0..20).filter(|_| budget.try_retry_at(now)).count();
        assert_eq!(share, 10);
        // Ten seconds later the old requests and retries are forgotten.
        let later = now + Duration::from_secs(11);
        let fresh = (0..20).filter(|_| budget.try_retry_at(later)).count();
        assert_eq!(fresh, 5);
        // No ratio and no floor: no retries at all.
        assert!(!RetryBudget::new(0.0, 0.0).try_retry());
    }
}
