//! The metrics of engines that serve both roles (`--dual`): each engine's duty, the split,
//! every change of duty and every warm-up of a new direction.

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};

/// The duty metric families.
#[derive(Clone)]
pub struct DutyMetrics {
    /// 1 on an engine's current duty's series, 0 on the other.
    pub duty: IntGaugeVec,
    /// The `--dual` engines on each duty.
    pub split: IntGaugeVec,
    /// Changes of duty, by model and the duty taken.
    pub changes: IntCounterVec,
    /// Warm-ups of a new direction before a change, by outcome.
    pub warmups: IntCounterVec,
}

impl DutyMetrics {
    /// Registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let gauges = |name: &str, help: &str, labels: &[&str]| {
            IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        let counters = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        let metrics = DutyMetrics {
            duty: gauges(
                "engine_duty",
                "1 on the duty (prefill, decode) an engine of both roles (--dual) serves now, 0 on the other",
                &["backend", "duty"],
            ),
            split: gauges(
                "dual_engines",
                "Engines of both roles (--dual) on each duty",
                &["duty"],
            ),
            changes: counters(
                "duty_changes_total",
                "Changes of an engine's duty, by model and the duty it took",
                &["model", "duty"],
            ),
            warmups: counters(
                "duty_warmups_total",
                "Warm-ups of an engine's new direction before its duty changes, by outcome (ok, failed: the duty stays)",
                &["outcome"],
            ),
        };
        for collector in [
            Box::new(metrics.duty.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(metrics.split.clone()),
            Box::new(metrics.changes.clone()),
            Box::new(metrics.warmups.clone()),
        ] {
            registry
                .register(collector)
                .expect("metric names are unique");
        }
        metrics
    }
}
