//! Predicted latency: each engine's time to first token (TTFT) and time per output token
//! (TPOT), learnt online from what this process sees ([`model`]), and the placement of
//! requests that carry latency targets where the prediction meets them with the most headroom.
//!
//! - **TTFT** of the engine that computes the prompt (the prefill; the decode when a request
//!   goes to it alone): from the prompt's tokens that engine does not hold (the KV events'
//!   index when followed; else the prompt's size) and its load (requests running and waiting).
//! - **TPOT** of the decode: from its load (the batch it runs).
//!
//! Every streamed answer teaches them (a placed request's forecast and the watch of its answer:
//! `crate::placement::forecast`); each prediction and its error are metrics.

pub mod model;

use std::time::Duration;

pub use crate::metrics::LatencyKind as Kind;
pub use model::EngineLatency;

/// How well `predicted` meets `target`: the share of the target left (negative: missed).
pub fn headroom(predicted: Duration, target: Duration) -> f64 {
    1.0 - predicted.as_secs_f64() / target.as_secs_f64().max(1e-9)
}

/// The candidate of `items` with the most headroom under `target` as `predict` sees it, and
/// its headroom; `None` when no candidate has a prediction yet.
pub fn most_headroom<'a, T>(
    items: impl Iterator<Item = &'a T>,
    target: Duration,
    predict: impl Fn(&T) -> Option<Duration>,
) -> Option<(&'a T, f64)>
where
    T: 'a,
{
    items
        .filter_map(|item| Some((item, headroom(predict(item)?, target))))
        .max_by(|a, b| a.1.total_cmp(&b.1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_headroom_wins_and_none_without_predictions() {
        let target = Duration::from_millis(100);
        let items = [Some(80u64), None, Some(20), Some(150)];
        let predict = |p: &Option<u64>| p.map(Duration::from_millis);
        let (best, room) = most_headroom(items.iter(), target, predict).unwrap();
        assert_eq!(*best, Some(20));
        assert!((room - 0.8).abs() < 1e-9);
        assert!(most_headroom([None::<u64>].iter(), target, predict).is_none());
        assert!(headroom(Duration::from_millis(150), target) < 0.0);
    }
}
