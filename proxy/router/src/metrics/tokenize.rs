//! The metrics of the proxy's own tokenization (for `precise_prefix`).

use std::time::Duration;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

/// The handles of the tokenization metrics.
#[derive(Clone)]
pub struct TokenizeMetrics {
    seconds: HistogramVec,
    failures: IntCounterVec,
}

const BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.1, 1.0,
];

impl TokenizeMetrics {
    /// Registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let seconds = HistogramVec::new(
            HistogramOpts::new(
                "tokenize_seconds",
                "Time to compute a prompt's token ids, by source (local: --tokenizer; engine: \
                 its POST /tokenize)",
            )
            .buckets(BUCKETS.to_vec()),
            &["source"],
        )
        .expect("valid metric");
        let failures = IntCounterVec::new(
            Opts::new(
                "tokenize_failures_total",
                "Prompts routed without their token ids, by source (request: a prompt shape \
                 that is not tokenized here)",
            ),
            &["source"],
        )
        .expect("valid metric");
        for metric in [
            Box::new(seconds.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(failures.clone()),
        ] {
            registry.register(metric).expect("metric names are unique");
        }
        TokenizeMetrics { seconds, failures }
    }

    /// A prompt tokenized by `source` in `took`.
    pub fn took(&self, source: &str, took: Duration) {
        self.seconds
            .with_label_values(&[source])
            .observe(took.as_secs_f64());
    }

    /// A prompt `source` could not tokenize.
    pub fn failed(&self, source: &str) {
        self.failures.with_label_values(&[source]).inc();
    }
}
