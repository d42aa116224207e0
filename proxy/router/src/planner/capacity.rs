//! One engine's rate at the latency targets: how many requests a second it takes while its
//! answers still meet them, from its latency models ([`crate::latency::model`]: the TTFT it
//! gives a prompt's uncached tokens at a load, the TPOT it gives at a batch).
//!
//! - **A prefill** serves one prompt after another: a queue of one server. Its mean uncached
//!   prompt gets a TTFT of `L` alone (the prefill and what no queue adds: the network, D's first
//!   step) and occupies the prefill for `S`, what each request queued ahead adds to a TTFT (its
//!   model's load term; `L` when that is not learnt). As an M/D/1 queue (DistServe, OSDI'24,
//!   §3.1: Poisson arrivals, a fixed service time) a utilisation `ρ` adds a wait of
//!   `ρS / (2(1−ρ))`, so `TTFT ≤ T` holds up to `ρ = 2x / (1 + 2x)` with `x = (T − L) / S`, and
//!   the rate is `ρ / S`. Sized on uncached tokens, so prefix hits make a prefill go further.
//! - **A decode** runs a batch: TPOT grows with it (linearly, as its model says), so the target
//!   allows a batch of at most `B` (capped by what the engine runs at most); by Little's law a
//!   batch of `B` answers of `L` tokens at TPOT `T` ends `B / (L·T)` answers a second.

use std::time::Duration;

/// The requests a second a prefill takes with TTFT within `target`, its mean prompt's TTFT
/// `alone` and its occupancy `service`; `None` when even alone it misses the target.
pub fn prefill_rate(alone: Duration, service: Duration, target: Duration) -> Option<f64> {
    if alone >= target {
        return None;
    }
    let service = service.as_secs_f64();
    if service <= 0.0 {
        return Some(f64::INFINITY);
    }
    let headroom = (target - alone).as_secs_f64() / service;
    let utilisation = 2.0 * headroom / (1.0 + 2.0 * headroom);
    Some(utilisation / service)
}

/// The largest batch whose TPOT meets `target`, TPOT being `idle` for a request alone and
/// `per_request` more for each other one in the batch, at most `max_batch`; `None` when even
/// alone it misses the target.
pub fn decode_batch(
    idle: Duration,
    per_request: Duration,
    target: Duration,
    max_batch: usize,
) -> Option<usize> {
    if idle > target {
        return None;
    }
    if per_request.is_zero() {
        return Some(max_batch.max(1));
    }
    let others = (target - idle).as_secs_f64() / per_request.as_secs_f64();
    // A hair over, so that a batch landing exactly on the target counts.
    Some((1 + (others + 1e-9).floor() as usize).min(max_batch.max(1)))
}

/// The answers a second a decode ends running `batch` answers of `answer_tokens` at a TPOT
/// of `tpot` (Little's law).
pub fn decode_rate(batch: usize, answer_tokens: f64, tpot: Duration) -> f64 {
    let answer_time = answer_tokens.max(1.0) * tpot.as_secs_f64();
    if answer_time <= 0.0 {
        return f64::INFINITY;
    }
    batch as f64 / answer_time
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    #[test]
    fn a_prefill_is_an_md1_queue_held_under_its_target() {
        // L = S = 1 s, T = 2 s: x = 1, rho = 2/3; the M/D/1 wait at rho = 2/3 is exactly 1 s.
        let rate = prefill_rate(ms(1_000), ms(1_000), ms(2_000)).unwrap();
        assert!((rate - 2.0 / 3.0).abs() < 1e-12, "{rate}");
        let rho: f64 = rate * 1.0;
        let wait = rho * 1.0 / (2.0 * (1.0 - rho));
        assert!((1.0 + wait - 2.0).abs() < 1e-12);
        // A faster prefill (fewer uncached tokens) takes more, a target it cannot meet none.
        assert!(prefill_rate(ms(500), ms(500), ms(2_000)).unwrap() > 2.0 * rate);
        assert_eq!(prefill_rate(ms(2_000), ms(1_000), ms(2_000)), None);
        // Latency that occupies nothing (the network, D's first step) costs headroom, not rate.
        let fixed = prefill_rate(ms(1_000), ms(200), ms(2_000)).unwrap();
        assert!((fixed - (10.0 / 11.0) / 0.2).abs() < 1e-9, "{fixed}");
    }

    #[test]
    fn a_decode_batch_is_held_under_the_tpot_target_and_its_cap() {
        // 20 ms alone, +0.5 ms a request, 50 ms target: 1 + 60 = 61 requests.
        assert_eq!(
            decode_batch(ms(20), Duration::from_micros(500), ms(50), 256),
            Some(61)
        );
        assert_eq!(
            decode_batch(ms(20), Duration::from_micros(500), ms(50), 32),
            Some(32)
        );
        assert_eq!(decode_batch(ms(20), Duration::ZERO, ms(50), 256), Some(256));
        assert_eq!(decode_batch(ms(60), Duration::ZERO, ms(50), 256), None);
        // 61 answers of 200 tokens at 50 ms: 61 / 10 s.
        assert!((decode_rate(61, 200.0, ms(50)) - 6.1).abs() < 1e-9);
    }
}
