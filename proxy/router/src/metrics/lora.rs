//! The metrics of LoRA adapters loaded on demand (`--lora-load-on-demand`).

use std::time::Duration;

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

/// How one load ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOutcome {
    /// The engine loaded it.
    Loaded,
    /// The engine had it already.
    AlreadyLoaded,
    /// The engine refused or failed.
    Failed,
    /// No answer in time.
    Timeout,
}

impl LoadOutcome {
    /// The `outcome` label.
    pub fn as_str(self) -> &'static str {
        match self {
            LoadOutcome::Loaded => "loaded",
            LoadOutcome::AlreadyLoaded => "already_loaded",
            LoadOutcome::Failed => "failed",
            LoadOutcome::Timeout => "timeout",
        }
    }
}

/// The handles of the adapter-load metrics.
#[derive(Clone)]
pub struct LoraMetrics {
    loads: IntCounterVec,
    seconds: HistogramVec,
}

impl LoraMetrics {
    /// Registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let loads = IntCounterVec::new(
            Opts::new(
                "lora_loads_total",
                "LoRA adapters loaded on an engine because a request needed them, by role and outcome",
            ),
            &["role", "outcome"],
        )
        .expect("valid metric");
        let seconds = HistogramVec::new(
            HistogramOpts::new(
                "lora_load_seconds",
                "Time an engine took to load a LoRA adapter on demand",
            )
            .buckets(vec![
                0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            ]),
            &["role"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(loads.clone()))
            .expect("metric names are unique");
        registry
            .register(Box::new(seconds.clone()))
            .expect("metric names are unique");
        LoraMetrics { loads, seconds }
    }

    /// Counts one load on a `role` backend.
    pub fn load(&self, role: &str, outcome: LoadOutcome, took: Duration) {
        self.loads
            .with_label_values(&[role, outcome.as_str()])
            .inc();
        self.seconds
            .with_label_values(&[role])
            .observe(took.as_secs_f64());
    }
}
