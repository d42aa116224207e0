//! An online linear model: recursive least squares with a forgetting factor, so it follows an
//! engine whose speed changes (another model loaded, a busier host) without a training step.
//! A few multiplications per sample; no history kept. [`EngineLatency`]: one engine's two
//! models (TTFT, TPOT) and their features.

use std::sync::Mutex;
use std::time::Duration;

use crate::sync::lock;

/// TTFT's features: a constant, thousands of prompt tokens to compute, load.
pub(crate) type TtftFeatures = [f64; 3];
/// TPOT's features: a constant, load.
pub(crate) type TpotFeatures = [f64; 2];

/// One engine's latency models.
#[derive(Debug, Default)]
pub struct EngineLatency {
    pub(crate) ttft: Mutex<Online<3>>,
    pub(crate) tpot: Mutex<Online<2>>,
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

pub(crate) fn ttft_features(uncached_tokens: usize, load: usize) -> TtftFeatures {
    [1.0, uncached_tokens as f64 / 1000.0, load as f64]
}

pub(crate) fn tpot_features(load: usize) -> TpotFeatures {
    [1.0, load as f64]
}

/// How much each older sample weighs less than the next (about the last 200 samples count).
const FORGETTING: f64 = 0.995;
/// The initial uncertainty (large: the first samples decide).
const PRIOR: f64 = 1_000.0;
/// Samples before the model predicts.
const MIN_SAMPLES: u64 = 5;

/// A linear model of `N` features, learnt one sample at a time.
#[derive(Debug, Clone)]
pub(crate) struct Online<const N: usize> {
    weights: [f64; N],
    covariance: [[f64; N]; N],
    samples: u64,
}

impl<const N: usize> Default for Online<N> {
    fn default() -> Self {
        let mut covariance = [[0.0; N]; N];
        for (i, row) in covariance.iter_mut().enumerate() {
            row[i] = PRIOR;
        }
        Online {
            weights: [0.0; N],
            covariance,
            samples: 0,
        }
    }
}

impl<const N: usize> Online<N> {
    /// The prediction for `x` (never negative), once enough samples were seen.
    pub(crate) fn predict(&self, x: &[f64; N]) -> Option<f64> {
        (self.samples >= MIN_SAMPLES).then(|| dot(&self.weights, x).max(0.0))
    }

    /// Learns that `x` gave `y`.
    pub(crate) fn learn(&mut self, x: &[f64; N], y: f64) {
        if !y.is_finite() || x.iter().any(|v| !v.is_finite()) {
            return;
        }
        let px: [f64; N] = std::array::from_fn(|i| dot(&self.covariance[i], x));
        let denominator = FORGETTING + dot(x, &px);
        let gain: [f64; N] = std::array::from_fn(|i| px[i] / denominator);
        let error = y - dot(&self.weights, x);
        for (weight, gain) in self.weights.iter_mut().zip(&gain) {
            *weight += gain * error;
        }
        for (row, gain) in self.covariance.iter_mut().zip(&gain) {
            for (cell, px) in row.iter_mut().zip(&px) {
                *cell = (*cell - gain * px) / FORGETTING;
            }
        }
        // A feature that never varies makes the covariance grow without bound: start over
        // from the prior, keeping the weights.
        let trace: f64 = (0..N).map(|i| self.covariance[i][i]).sum();
        if !trace.is_finite() || trace > PRIOR * 1e3 {
            let weights = self.weights;
            *self = Online {
                weights,
                samples: self.samples,
                ..Online::default()
            };
        }
        self.samples += 1;
    }
}

fn dot<const N: usize>(a: &[f64; N], b: &[f64; N]) -> f64 {
    a.iter().zip(b).map(|(a, b)| a * b).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_a_linear_law_and_follows_it_when_it_changes() {
        let mut model = Online::<3>::default();
        assert_eq!(model.predict(&[1.0, 1.0, 1.0]), None);
        let law = |k: f64, load: f64| 0.02 + 0.05 * k + 0.01 * load;
        for i in 0..200 {
            let (k, load) = ((i % 7) as f64, (i % 5) as f64);
            model.learn(&[1.0, k, load], law(k, load));
        }
        let predicted = model.predict(&[1.0, 3.0, 4.0]).unwrap();
        assert!((predicted - law(3.0, 4.0)).abs() < 1e-3, "{predicted}");
        // The engine became twice as slow.
        for i in 0..600 {
            let (k, load) = ((i % 7) as f64, (i % 5) as f64);
            model.learn(&[1.0, k, load], 2.0 * law(k, load));
        }
        let predicted = model.predict(&[1.0, 3.0, 4.0]).unwrap();
        assert!(
            (predicted - 2.0 * law(3.0, 4.0)).abs() < 1e-2,
            "{predicted}"
        );
        // A feature that never varies does not break it.
        let mut flat = Online::<2>::default();
        for _ in 0..10_000 {
            flat.learn(&[1.0, 0.0], 0.5);
        }
        assert!((flat.predict(&[1.0, 0.0]).unwrap() - 0.5).abs() < 1e-6);
    }
}
