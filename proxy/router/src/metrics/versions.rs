//! The metric of the engines' versions (`GET /version`).

use prometheus::{IntCounterVec, Opts, Registry};

/// The handle of the engine version metric.
#[derive(Clone)]
pub struct VersionMetrics {
    /// Requests placed on a prefill and a decode that report different versions.
    pub(crate) mixed: IntCounterVec,
}

impl VersionMetrics {
    /// Registers it in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let mixed = IntCounterVec::new(
            Opts::new(
                "mixed_version_pairs_total",
                "Requests placed on a prefill and a decode of different engine versions (GET \
                 /version; the KV layout and connector may differ between releases)",
            ),
            &["prefill_version", "decode_version"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(mixed.clone()))
            .expect("metric names are unique");
        VersionMetrics { mixed }
    }
}
