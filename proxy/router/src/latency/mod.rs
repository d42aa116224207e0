//! Predicted latency: each engine's time to first token (TTFT) and time per output token
//! (TPOT), learnt online from what this process sees ([`model`]), and the placement of
//! requests that carry latency targets where the prediction meets them with the most headroom.
//!
//! - **TTFT** of the engine that computes the prompt (the prefill; the decode when a request
//!   goes to it alone): from the prompt's tokens that engine does not hold (the KV events'
//!   index when followed; else the prompt's size) and its load (requests running and waiting).
//! - **TPOT** of the decode: from its load (the batch it runs).
//!
//! Every streamed answer teaches them ([`Watch`]: its first chunk, then its chunks and their
//! pace); each prediction and its error are metrics.

pub(crate) mod model;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::admission::Targets;
use crate::backend::Backend;
use crate::metrics::LatencyMetrics;
use crate::sync::lock;
use model::Online;

/// TTFT's features: a constant, thousands of prompt tokens to compute, load.
type TtftFeatures = [f64; 3];
/// TPOT's features: a constant, load.
type TpotFeatures = [f64; 2];

/// One engine's latency models.
#[derive(Debug, Default)]
pub struct EngineLatency {
    ttft: Mutex<Online<3>>,
    tpot: Mutex<Online<2>>,
}

impl EngineLatency {
    /// The TTFT predicted for `uncached_tokens` to compute at `load`.
    pub fn ttft(&self, uncached_tokens: usize, load: usize) -> Option<Duration> {
        let seconds = lock(&self.ttft).predict(&ttft_features(uncached_tokens, load))?;
        Duration::try_from_secs_f64(seconds).ok()
    }

    /// The TPOT predicted at `load`.
    pub fn tpot(&self, load: usize) -> Option<Duration> {
        let seconds = lock(&self.tpot).predict(&tpot_features(load))?;
        Duration::try_from_secs_f64(seconds).ok()
    }
}

fn ttft_features(uncached_tokens: usize, load: usize) -> TtftFeatures {
    [1.0, uncached_tokens as f64 / 1000.0, load as f64]
}

fn tpot_features(load: usize) -> TpotFeatures {
    [1.0, load as f64]
}

/// Which latency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Time to first token.
    Ttft,
    /// Time per output token.
    Tpot,
}

impl Kind {
    /// The `kind` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Ttft => "ttft",
            Kind::Tpot => "tpot",
        }
    }
}

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

/// What a placed request's latency depends on at one engine.
struct Estimate {
    engine: Arc<Backend>,
    features: Vec<f64>,
}

/// A placed request's latency at the engine that computes its prompt (TTFT) and at its decode
/// (TPOT), and its targets. The predictions are made when asked, or when the answer's latency
/// is learnt (checked against it first), so a request nobody asks about costs no lock.
pub struct Forecast {
    placed_at: Instant,
    ttft: Estimate,
    tpot: Estimate,
    targets: Targets,
    metrics: LatencyMetrics,
}

impl Forecast {
    /// The forecast for a prompt of `uncached_tokens` at `prompt_engine` and decoded at
    /// `decode`, their loads as now.
    pub(crate) fn new(
        prompt_engine: &Arc<Backend>,
        uncached_tokens: usize,
        decode: &Arc<Backend>,
        targets: Targets,
        metrics: LatencyMetrics,
    ) -> Self {
        Forecast {
            placed_at: Instant::now(),
            ttft: Estimate {
                engine: prompt_engine.clone(),
                features: ttft_features(uncached_tokens, prompt_engine.load()).to_vec(),
            },
            tpot: Estimate {
                engine: decode.clone(),
                features: tpot_features(decode.load()).to_vec(),
            },
            targets,
            metrics,
        }
    }

    /// The predicted TTFT, when the engine's model has learnt enough.
    pub fn ttft(&self) -> Option<Duration> {
        predict(Kind::Ttft, &self.ttft)
    }

    /// The predicted TPOT, when the decode's model has learnt enough.
    pub fn tpot(&self) -> Option<Duration> {
        predict(Kind::Tpot, &self.tpot)
    }

    /// Whether a prediction misses one of the request's targets (false when nothing is
    /// predicted, or no target is set).
    pub fn misses_targets(&self) -> bool {
        let misses = |target: Option<Duration>, predicted: &dyn Fn() -> Option<Duration>| {
            target.is_some_and(|target| predicted().is_some_and(|p| p > target))
        };
        misses(self.targets.ttft, &|| self.ttft()) || misses(self.targets.tpot, &|| self.tpot())
    }

    /// Whether `decode` is the decode it predicted for (not another after a retry).
    pub fn is_for(&self, decode: &Backend) -> bool {
        std::ptr::eq(&*self.tpot.engine, decode)
    }

    /// Starts watching the answer (its TTFT counted from the placement).
    pub fn watch(self) -> Watch {
        Watch {
            started: self.placed_at,
            forecast: self,
            first: None,
            events: 0,
        }
    }

    /// Checks the prediction for `kind` against `measured`, then learns it.
    fn learn(&self, kind: Kind, measured: Duration) {
        let seconds = measured.as_secs_f64();
        let estimate = match kind {
            Kind::Ttft => &self.ttft,
            Kind::Tpot => &self.tpot,
        };
        let latency = &estimate.engine.latency;
        let predicted = match kind {
            Kind::Ttft => {
                let x: TtftFeatures = std::array::from_fn(|i| estimate.features[i]);
                let mut model = lock(&latency.ttft);
                let predicted = model.predict(&x);
                model.learn(&x, seconds);
                predicted
            }
            Kind::Tpot => {
                let x: TpotFeatures = std::array::from_fn(|i| estimate.features[i]);
                let mut model = lock(&latency.tpot);
                let predicted = model.predict(&x);
                model.learn(&x, seconds);
                predicted
            }
        };
        let predicted = predicted.and_then(|p| Duration::try_from_secs_f64(p).ok());
        self.metrics.observed(kind, measured, predicted);
    }
}

/// `kind`'s prediction from `estimate`'s features.
fn predict(kind: Kind, estimate: &Estimate) -> Option<Duration> {
    let latency = &estimate.engine.latency;
    let seconds = match kind {
        Kind::Ttft => {
            let x: TtftFeatures = std::array::from_fn(|i| estimate.features[i]);
            lock(&latency.ttft).predict(&x)?
        }
        Kind::Tpot => {
            let x: TpotFeatures = std::array::from_fn(|i| estimate.features[i]);
            lock(&latency.tpot).predict(&x)?
        }
    };
    Duration::try_from_secs_f64(seconds).ok()
}

/// Watches a streamed answer for its first chunk and its pace, and teaches the engines'
/// models what it saw when the answer ends well ([`Watch::ended`]).
pub struct Watch {
    forecast: Forecast,
    started: Instant,
    first: Option<Instant>,
    events: usize,
}

impl Watch {
    /// Notes a chunk of the answer arrived now (server-sent events: each `data:` line is one
    /// token's).
    pub fn chunk(&mut self, chunk: &[u8]) {
        self.chunk_at(chunk, Instant::now());
    }

    /// Notes a chunk of the answer that arrived at `at`.
    pub fn chunk_at(&mut self, chunk: &[u8], at: Instant) {
        if self.first.is_none() {
            self.first = Some(at);
        }
        self.events += count_events(chunk);
    }

    /// The answer ended well: its TTFT and, over three events or more, its TPOT are learnt.
    pub fn ended(self) {
        let Some(first) = self.first else { return };
        self.forecast
            .learn(Kind::Ttft, first.saturating_duration_since(self.started));
        // The last event is `[DONE]`; the first carries the first token.
        let tokens = self.events.saturating_sub(1);
        if tokens >= 3 {
            let pace = first.elapsed().as_secs_f64() / (tokens - 1) as f64;
            self.forecast
                .learn(Kind::Tpot, Duration::from_secs_f64(pace));
        }
    }
}

/// The server-sent events that begin in `chunk` (each `data:` at a line's start).
fn count_events(chunk: &[u8]) -> usize {
    memchr::memmem::find_iter(chunk, b"data:")
        .filter(|&at| at == 0 || chunk[at - 1] == b'\n')
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_counted_at_line_starts() {
        assert_eq!(count_events(b"data: {\"a\":1}\n\ndata: {}\n\n"), 2);
        assert_eq!(count_events(b"{\"text\":\"data:\"}"), 0);
        assert_eq!(count_events(b"data: [DONE]\n\n"), 1);
    }

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
