//! The work a policy has sent each candidate and not yet seen done: the uncached prompt tokens
//! of its requests (and how many) from the pick until the request's placement ends (D's answer
//! has begun: P has computed the prompt and D has pulled it). A [`Pending`] guard, kept with the
//! request, takes its share back when dropped, so a failed or cancelled request cannot leave
//! work behind.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::sync::lock;

/// A candidate's pending work.
#[derive(Debug, Default)]
pub struct Work {
    tokens: AtomicU64,
    requests: AtomicU64,
}

impl Work {
    /// Uncached prompt tokens pending.
    pub fn tokens(&self) -> u64 {
        self.tokens.load(Ordering::Relaxed)
    }

    /// Requests pending.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }
}

/// One request's share of a candidate's work, given back on drop.
#[derive(Debug)]
pub struct Pending {
    work: Arc<Work>,
    tokens: u64,
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.work.tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        self.work.requests.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Every candidate's pending work, by candidate identity.
#[derive(Debug, Default)]
pub struct QueuedWork {
    by_candidate: Mutex<HashMap<u64, Arc<Work>>>,
}

/// Candidates remembered before idle ones are forgotten (candidates come and go with
/// discovery).
const MAX_CANDIDATES: usize = 4096;

impl QueuedWork {
    /// The pending work of candidate `id`.
    pub fn of(&self, id: u64) -> Arc<Work> {
        let mut all = lock(&self.by_candidate);
        if all.len() >= MAX_CANDIDATES && !all.contains_key(&id) {
            all.retain(|_, work| work.requests() > 0);
        }
        all.entry(id).or_default().clone()
    }

    /// Adds a request of `tokens` uncached tokens to candidate `id`'s work.
    pub fn add(&self, id: u64, tokens: u64) -> Pending {
        let work = self.of(id);
        work.tokens.fetch_add(tokens, Ordering::Relaxed);
        work.requests.fetch_add(1, Ordering::Relaxed);
        Pending { work, tokens }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_is_given_back_when_the_request_ends() {
        let queued = QueuedWork::default();
        let first = queued.add(7, 100);
        let second = queued.add(7, 20);
        assert_eq!((queued.of(7).tokens(), queued.of(7).requests()), (120, 2));
        drop(first);
        assert_eq!((queued.of(7).tokens(), queued.of(7).requests()), (20, 1));
        drop(second);
        assert_eq!(queued.of(7).tokens(), 0);
        assert_eq!(queued.of(8).requests(), 0);
    }
}
