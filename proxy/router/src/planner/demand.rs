//! A model's demand over the last window, from what the front door saw: requests arriving per
//! second (all of them, and those sent through a prefill), their mean prompt and uncached
//! prompt tokens, and the mean answer length of the answers that ended. Kept in buckets of one
//! second, so its memory is bounded by the window, whatever the traffic.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// One second of arrivals and answers.
#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    second: u64,
    arrivals: u64,
    through_prefill: u64,
    prompt_tokens: u64,
    uncached_tokens: u64,
    answers: u64,
    answer_tokens: u64,
}

/// The window's arrivals and answers, one bucket a second.
#[derive(Debug)]
pub struct Demand {
    started: Instant,
    window: Duration,
    buckets: VecDeque<Bucket>,
}

/// What the window says of a model's demand.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DemandRates {
    /// Requests arriving per second.
    pub requests_per_second: f64,
    /// Of them, those sent through a prefill, per second.
    pub prefills_per_second: f64,
    /// The mean prompt, tokens.
    pub prompt_tokens: f64,
    /// The mean part of a prompt sent through a prefill that its prefill did not hold,
    /// tokens: what it computes.
    pub uncached_tokens: f64,
    /// The mean answer of those that ended, tokens (none: no answer ended in the window).
    pub answer_tokens: Option<f64>,
    /// How long the window has watched: the window, or less since the start.
    pub observed: Duration,
}

impl Demand {
    /// An empty window of `window` (at least a second), watching from `now`.
    pub fn new(window: Duration, now: Instant) -> Self {
        Demand {
            started: now,
            window: window.max(Duration::from_secs(1)),
            buckets: VecDeque::new(),
        }
    }

    /// Counts a request that arrived at `now` with `prompt_tokens`, of which `uncached_tokens`
    /// its prefill computes (`None`: it was served by a decode alone).
    pub fn arrived(&mut self, now: Instant, prompt_tokens: usize, uncached_tokens: Option<usize>) {
        let bucket = self.bucket(now);
        bucket.arrivals += 1;
        bucket.prompt_tokens += prompt_tokens as u64;
        if let Some(uncached) = uncached_tokens {
            bucket.through_prefill += 1;
            bucket.uncached_tokens += uncached as u64;
        }
    }

    /// Counts an answer of `tokens` that ended at `now`.
    pub fn answered(&mut self, now: Instant, tokens: usize) {
        let bucket = self.bucket(now);
        bucket.answers += 1;
        bucket.answer_tokens += tokens as u64;
    }

    /// The window's rates at `now`.
    pub fn rates(&mut self, now: Instant) -> DemandRates {
        self.forget(self.second(now));
        let sum = self.buckets.iter().fold(Bucket::default(), |a, b| Bucket {
            second: 0,
            arrivals: a.arrivals + b.arrivals,
            through_prefill: a.through_prefill + b.through_prefill,
            prompt_tokens: a.prompt_tokens + b.prompt_tokens,
            uncached_tokens: a.uncached_tokens + b.uncached_tokens,
            answers: a.answers + b.answers,
            answer_tokens: a.answer_tokens + b.answer_tokens,
        });
        let observed = now.saturating_duration_since(self.started).min(self.window);
        let seconds = observed.as_secs_f64().max(1.0);
        let mean = |total: u64, count: u64| total as f64 / count.max(1) as f64;
        DemandRates {
            requests_per_second: sum.arrivals as f64 / seconds,
            prefills_per_second: sum.through_prefill as f64 / seconds,
            prompt_tokens: mean(sum.prompt_tokens, sum.arrivals),
            uncached_tokens: mean(sum.uncached_tokens, sum.through_prefill),
            answer_tokens: (sum.answers > 0).then(|| mean(sum.answer_tokens, sum.answers)),
            observed,
        }
    }

    fn second(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.started).as_secs()
    }

    /// Drops the buckets older than the window at `second`.
    fn forget(&mut self, second: u64) {
        let oldest = second.saturating_sub(self.window.as_secs().saturating_sub(1));
        while self.buckets.front().is_some_and(|b| b.second < oldest) {
            self.buckets.pop_front();
        }
    }

    fn bucket(&mut self, now: Instant) -> &mut Bucket {
        let second = self.second(now);
        self.forget(second);
        if self.buckets.back().is_none_or(|b| b.second != second) {
            self.buckets.push_back(Bucket {
                second,
                ..Bucket::default()
            });
        }
        self.buckets.back_mut().expect("a bucket was just pushed")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_the_windows_and_old_seconds_are_forgotten() {
        let start = Instant::now();
        let mut demand = Demand::new(Duration::from_secs(10), start);
        let at = |s: u64| start + Duration::from_secs(s);
        // Two requests a second for 10 s: one through a prefill (2,000 of 3,000 tokens to
        // compute), one to a decode alone (1,000 tokens); 100-token answers.
        for s in 0..10 {
            demand.arrived(at(s), 3_000, Some(2_000));
            demand.arrived(at(s), 1_000, None);
            demand.answered(at(s), 100);
        }
        let rates = demand.rates(at(10) - Duration::from_millis(1));
        assert_eq!(rates.observed, Duration::from_millis(9_999));
        assert!((rates.requests_per_second - 2.0).abs() < 0.01, "{rates:?}");
        assert!((rates.prefills_per_second - 1.0).abs() < 0.01);
        assert_eq!(rates.prompt_tokens, 2_000.0);
        assert_eq!(rates.uncached_tokens, 2_000.0);
        assert_eq!(rates.answer_tokens, Some(100.0));
        // At 14 s the window holds seconds 5 to 14: half of the requests.
        let rates = demand.rates(at(14));
        assert!((rates.requests_per_second - 1.0).abs() < 0.01, "{rates:?}");
        // And after a whole window nothing is left.
        let rates = demand.rates(at(30));
        assert_eq!(rates.requests_per_second, 0.0);
        assert_eq!(rates.answer_tokens, None);
        assert!(demand.buckets.is_empty());
    }

    #[test]
    fn a_young_window_divides_by_what_it_watched() {
        let start = Instant::now();
        let mut demand = Demand::new(Duration::from_secs(60), start);
        for i in 0..20 {
            demand.arrived(start + Duration::from_millis(i * 250), 100, Some(100));
        }
        let rates = demand.rates(start + Duration::from_secs(5));
        assert_eq!(rates.observed, Duration::from_secs(5));
        assert!((rates.requests_per_second - 4.0).abs() < 1e-9);
    }
}
