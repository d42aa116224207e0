//! A placed request's forecast: what its latency depends on at the engine that computes its
//! prompt (TTFT) and at its decode (TPOT), predicted from their models
//! ([`crate::latency::model`]) when asked; and the [`Watch`] of its streamed answer, which
//! checks the predictions against what the answer got and teaches the models.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::admission::class::Targets;
use crate::backend::Backend;
use crate::latency::model::{tpot_features, ttft_features, TpotFeatures, TtftFeatures};
use crate::latency::Kind;
use crate::metrics::LatencyMetrics;
use crate::planner::LivePlanner;
use crate::sync::lock;

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
    uncached_tokens: usize,
    targets: Targets,
    metrics: LatencyMetrics,
    /// The capacity planner the answer's length is told to, and the request's model.
    planner: Option<(Arc<LivePlanner>, Option<Arc<str>>)>,
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
            uncached_tokens,
            targets,
            metrics,
            planner: None,
        }
    }

    /// The prompt's tokens the engine that computes it does not hold.
    pub fn uncached_tokens(&self) -> usize {
        self.uncached_tokens
    }

    /// Tells `planner` the answer's length when it ends (a request for `model`).
    pub(crate) fn tell(&mut self, planner: Arc<LivePlanner>, model: Option<&str>) {
        self.planner = Some((planner, model.map(Arc::from)));
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

    /// The answer ended well: its TTFT and, over three events or more, its TPOT are learnt,
    /// and its length told to the capacity planner.
    pub fn ended(self) {
        let Some(first) = self.first else { return };
        self.forecast
            .learn(Kind::Ttft, first.saturating_duration_since(self.started));
        // The last event is `[DONE]`; the first carries the first token.
        let tokens = self.events.saturating_sub(1);
        if let Some((planner, model)) = &self.forecast.planner {
            planner.answered(model.as_deref(), tokens);
        }
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
}
