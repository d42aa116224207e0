//! Whether an engine can take more work now, from its own signals: the requests waiting in its
//! scheduler and the share of its KV cache in use (vLLM's `vllm:num_requests_waiting` and
//! `vllm:kv_cache_usage_perc`, SGLang's `sglang:num_queue_reqs` and `sglang:token_usage`, read
//! with its load at `--engine-metrics-interval`), and the requests this process has in flight
//! on it. Between two reads the requests sent since count: they fill the batch's free slots
//! (its size learnt from the reads that saw it full), then wait. An engine past a threshold is
//! saturated; so is one whose metrics stopped answering (its last report older than three
//! intervals), since nothing says it is not; one without `/metrics` is judged on the requests
//! in flight alone. A pool is saturated when every engine that could take a request is.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::sync::lock;

/// What makes an engine saturated (`--saturation-*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SaturationConfig {
    /// Requests waiting at the engine from which it is saturated (0: not judged on them).
    pub waiting: usize,
    /// The share of its KV cache in use from which it is saturated (0: not judged on it).
    pub kv_usage: f64,
    /// Requests in flight from this process from which it is saturated (0: not judged on
    /// them).
    pub in_flight: usize,
    /// How old an engine's last report may be before it counts as saturated.
    pub stale_after: Duration,
}

impl Default for SaturationConfig {
    fn default() -> Self {
        SaturationConfig {
            waiting: 5,
            kv_usage: 0.95,
            in_flight: 0,
            stale_after: Duration::from_secs(6),
        }
    }
}

/// Why an engine is saturated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saturated {
    /// Too many requests wait in its scheduler.
    Waiting,
    /// Its KV cache is (nearly) full.
    KvCache,
    /// Too many requests are in flight on it from this process.
    InFlight,
    /// It reported once, and not since the window.
    Stale,
}

impl Saturated {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Saturated::Waiting => "waiting",
            Saturated::KvCache => "kv_cache",
            Saturated::InFlight => "in_flight",
            Saturated::Stale => "stale",
        }
    }
}

/// What an engine last reported of its scheduler and cache.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineSignals {
    /// Requests waiting to run (none: not reported).
    pub waiting: Option<usize>,
    /// Requests running in its batch (none: not reported).
    pub running: Option<usize>,
    /// The share of its KV cache in use, 0 to 1 (none: not reported).
    pub kv_usage: Option<f64>,
}

/// An engine's last report.
#[derive(Debug, Clone, Copy)]
struct Report {
    signals: EngineSignals,
    at: Instant,
    /// Its batch's size when it was last full (requests were waiting): what it runs at most.
    batch: Option<usize>,
}

/// An engine's signals as last read, and when.
#[derive(Debug, Default)]
pub struct Signals(Mutex<Option<Report>>);

impl Signals {
    /// Records a report read at `at`.
    pub fn record(&self, signals: EngineSignals, at: Instant) {
        let mut last = lock(&self.0);
        let full = signals.waiting.is_some_and(|w| w > 0);
        let known = last.and_then(|report| report.batch);
        let batch = match (full, signals.running) {
            (true, Some(running)) if running > 0 => Some(running),
            // More running than the batch once seen full: it grew (KV freed, a restart).
            (false, Some(running)) => known.map(|batch| batch.max(running)),
            _ => known,
        };
        *last = Some(Report { signals, at, batch });
    }

    /// When the engine last reported, and the batch it was then known to run at most.
    pub fn last_report(&self) -> Option<(Instant, Option<usize>)> {
        lock(&self.0).map(|report| (report.at, report.batch))
    }

    /// Whether the engine is saturated at `now` under `config`, with `in_flight` requests of
    /// this process on it, and why.
    pub fn saturated(
        &self,
        config: &SaturationConfig,
        in_flight: usize,
        now: Instant,
    ) -> Option<Saturated> {
        let judged = self.judge(config, in_flight, now);
        judged
            .standing
            .or((in_flight >= judged.saturates_at).then_some(judged.counted))
    }

    /// The judgement at `now` with `in_flight` requests of this process on the engine: what
    /// holds until the next report (stale, KV cache), and from how many requests in flight
    /// it is saturated by requests waiting or in flight. The engine's waiting requests are
    /// estimated between two reads as the count it reported plus the requests this process
    /// sent it since, less those that ended: saturation follows each request, not only each
    /// read.
    pub fn judge(&self, config: &SaturationConfig, in_flight: usize, now: Instant) -> Judgement {
        let mut judged = Judgement {
            standing: None,
            saturates_at: match config.in_flight {
                0 => usize::MAX,
                limit => limit,
            },
            counted: Saturated::InFlight,
        };
        let Some(Report { signals, at, batch }) = *lock(&self.0) else {
            return judged;
        };
        if now.saturating_duration_since(at) > config.stale_after {
            judged.standing = Some(Saturated::Stale);
        } else if config.kv_usage > 0.0 && signals.kv_usage.is_some_and(|u| u >= config.kv_usage) {
            judged.standing = Some(Saturated::KvCache);
        }
        // Requests sent from now on fill the batch's free slots, then wait. With requests
        // waiting the batch is full; with none, its free slots are known once it was seen
        // full (its size then); else they are not, until the next read.
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let free = match (signals.waiting, signals.running, batch) {
            (Some(waiting), _, _) if waiting > 0 => Some(-count(waiting)),
            (Some(_), Some(running), Some(batch)) => Some(count(batch.saturating_sub(running))),
            _ => None,
        };
        if let Some(free) = free.filter(|_| config.waiting > 0) {
            let at = (count(in_flight).saturating_add(free))
                .saturating_add(count(config.waiting))
                .max(0);
            let at = usize::try_from(at).unwrap_or(usize::MAX);
            if at <= judged.saturates_at {
                judged.saturates_at = at;
                judged.counted = Saturated::Waiting;
            }
        }
        judged
    }
}

/// One judgement of an engine's saturation (see [`Signals::judge`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Judgement {
    /// Saturated until the next report, whatever is sent to it: silent, or its KV cache full.
    pub standing: Option<Saturated>,
    /// Saturated while this process has at least this many requests in flight on it.
    pub saturates_at: usize,
    /// Why, when it is by the requests in flight.
    pub counted: Saturated,
}

/// Whether some of the `items` that `usable` accepts are saturated and some are not: the
/// policies then choose among those with room (a saturated engine gets no new request while
/// another could take it).
pub fn mixed<T>(items: &[T], usable: impl Fn(&T) -> bool, saturated: impl Fn(&T) -> bool) -> bool {
    let (mut full, mut room) = (false, false);
    for item in items.iter().filter(|item| usable(item)) {
        match saturated(item) {
            true => full = true,
            false => room = true,
        }
        if full && room {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_signal_past_its_threshold_saturates_and_silence_too() {
        let config = SaturationConfig {
            waiting: 4,
            kv_usage: 0.9,
            in_flight: 10,
            stale_after: Duration::from_secs(6),
        };
        let signals = Signals::default();
        let now = Instant::now();
        // Never reported (no /metrics): only the requests in flight count.
        assert_eq!(signals.saturated(&config, 9, now), None);
        assert_eq!(
            signals.saturated(&config, 10, now),
            Some(Saturated::InFlight)
        );
        let report = |waiting, kv_usage| EngineSignals {
            waiting: Some(waiting),
            running: None,
            kv_usage: Some(kv_usage),
        };
        signals.record(report(3, 0.5), now);
        assert_eq!(signals.saturated(&config, 0, now), None);
        signals.record(report(4, 0.5), now);
        assert_eq!(signals.saturated(&config, 0, now), Some(Saturated::Waiting));
        signals.record(report(0, 0.95), now);
        assert_eq!(signals.saturated(&config, 0, now), Some(Saturated::KvCache));
        signals.record(report(0, 0.1), now);
        let later = now + Duration::from_secs(7);
        assert_eq!(signals.saturated(&config, 0, later), Some(Saturated::Stale));
        let off = SaturationConfig {
            waiting: 0,
            kv_usage: 0.0,
            in_flight: 0,
            ..config
        };
        signals.record(report(100, 1.0), now);
        assert_eq!(signals.saturated(&off, 1000, now), None);
        // Between reads, the requests sent since count as waiting, those ended as gone.
        signals.record(report(2, 0.1), now);
        let judged = signals.judge(&config, 3, now);
        // Two waiting at the read with three in flight: two more sent make four waiting.
        assert_eq!((judged.standing, judged.saturates_at), (None, 5));
        assert_eq!(judged.counted, Saturated::Waiting);
        // With none waiting, the free slots of a batch once seen full (4 running, 1 waiting).
        let batch = |running, waiting| EngineSignals {
            running: Some(running),
            waiting: Some(waiting),
            kv_usage: None,
        };
        let config = SaturationConfig {
            in_flight: 0,
            ..config
        };
        let fresh = Signals::default();
        fresh.record(batch(1, 0), now);
        assert_eq!(fresh.judge(&config, 1, now).saturates_at, usize::MAX);
        fresh.record(batch(4, 1), now);
        fresh.record(batch(1, 0), now);
        // Three free slots, then four may wait: saturated from 1 + 3 + 4.
        assert_eq!(fresh.judge(&config, 1, now).saturates_at, 8);
    }
}
