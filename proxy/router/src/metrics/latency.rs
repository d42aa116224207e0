//! The latency predictions' metrics: what was measured, and how far the prediction made at
//! placement was from it (when the engine's model predicted), by kind (`ttft`, `tpot`).

use std::time::Duration;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts, Registry,
};

/// Which latency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LatencyKind {
    /// Time to first token.
    Ttft,
    /// Time per output token.
    Tpot,
}

impl LatencyKind {
    /// The `kind` label.
    pub fn as_str(self) -> &'static str {
        match self {
            LatencyKind::Ttft => "ttft",
            LatencyKind::Tpot => "tpot",
        }
    }
}

use LatencyKind as Kind;

/// The handles of the latency metrics, resolved per kind (and direction) once.
#[derive(Clone)]
pub struct LatencyMetrics {
    /// Per kind: measured, predicted over, predicted under, unpredicted.
    kinds: [KindMetrics; 2],
}

#[derive(Clone)]
struct KindMetrics {
    measured: Histogram,
    over: Histogram,
    under: Histogram,
    unpredicted: IntCounter,
}

impl LatencyMetrics {
    /// Registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let buckets = vec![
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ];
        let measured = HistogramVec::new(
            HistogramOpts::new(
                "latency_measured_seconds",
                "TTFT and time per output token measured on streamed answers, by kind",
            )
            .buckets(buckets.clone()),
            &["kind"],
        )
        .expect("valid metric");
        let error = HistogramVec::new(
            HistogramOpts::new(
                "latency_prediction_error_seconds",
                "How far the prediction made at placement was from the measured latency, by kind and direction (over: predicted more)",
            )
            .buckets(buckets),
            &["kind", "direction"],
        )
        .expect("valid metric");
        let unpredicted = IntCounterVec::new(
            Opts::new(
                "latency_unpredicted_total",
                "Latencies measured where the engine's model had not learnt enough to predict, by kind",
            ),
            &["kind"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(measured.clone()))
            .expect("registered once");
        registry
            .register(Box::new(error.clone()))
            .expect("registered once");
        registry
            .register(Box::new(unpredicted.clone()))
            .expect("registered once");
        let kind = |kind: Kind| {
            let kind = kind.as_str();
            KindMetrics {
                measured: measured.with_label_values(&[kind]),
                over: error.with_label_values(&[kind, "over"]),
                under: error.with_label_values(&[kind, "under"]),
                unpredicted: unpredicted.with_label_values(&[kind]),
            }
        };
        LatencyMetrics {
            kinds: [kind(Kind::Ttft), kind(Kind::Tpot)],
        }
    }

    /// Counts a measured latency of `kind` and its prediction's error.
    pub fn observed(&self, kind: Kind, measured: Duration, predicted: Option<Duration>) {
        let metrics = &self.kinds[kind as usize];
        metrics.measured.observe(measured.as_secs_f64());
        let Some(predicted) = predicted else {
            metrics.unpredicted.inc();
            return;
        };
        match predicted >= measured {
            true => metrics.over.observe((predicted - measured).as_secs_f64()),
            false => metrics.under.observe((measured - predicted).as_secs_f64()),
        }
    }
}
