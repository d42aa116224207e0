//! Whether an engine can take more work now, from its own signals: the requests waiting in its
//! scheduler and the share of its KV cache in use (vLLM's `vllm:num_requests_waiting` and
//! `vllm:kv_cache_usage_perc`, SGLang's `sglang:num_queue_reqs` and `sglang:token_usage`, read
//! with its load at `--engine-metrics-interval`), and the requests this process has in flight
//! on it. An engine past a threshold is saturated; so is one whose metrics stopped answering
//! (its last report older than three intervals), since nothing says it is not; one without
//! `/metrics` is judged on the requests in flight alone. A pool is saturated when every engine
//! that could take a request is.

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
    /// The share of its KV cache in use, 0 to 1 (none: not reported).
    pub kv_usage: Option<f64>,
}

/// An engine's signals as last read, and when.
#[derive(Debug, Default)]
pub struct Signals(Mutex<Option<(EngineSignals, Instant)>>);

impl Signals {
    /// Records a report read at `at`.
    pub fn record(&self, signals: EngineSignals, at: Instant) {
        *lock(&self.0) = Some((signals, at));
    }

    /// Whether the engine is saturated at `now` under `config`, with `in_flight` requests of
    /// this process on it, and why.
    pub fn saturated(
        &self,
        config: &SaturationConfig,
        in_flight: usize,
        now: Instant,
    ) -> Option<Saturated> {
        if config.in_flight > 0 && in_flight >= config.in_flight {
            return Some(Saturated::InFlight);
        }
        let (signals, at) = (*lock(&self.0))?;
        if now.saturating_duration_since(at) > config.stale_after {
            return Some(Saturated::Stale);
        }
        if config.waiting > 0 && signals.waiting.is_some_and(|w| w >= config.waiting) {
            return Some(Saturated::Waiting);
        }
        if config.kv_usage > 0.0 && signals.kv_usage.is_some_and(|u| u >= config.kv_usage) {
            return Some(Saturated::KvCache);
        }
        None
    }
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
    }
}
