//! pd-epp's Prometheus metrics, `pd_epp_*`: its picks and how long each took, the exchanges
//! Envoy holds open, where the gateway actually sent each request, beside the fleet's (the
//! router's, under the same prefix).

use std::time::Duration;

use pd_router::metrics::FleetMetrics;
use pd_router::routing::decision::Decision;
use pd_router::tenants::metrics::TenantMetrics;
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

/// Every metric pd-epp exports, in its own registry.
pub struct Metrics {
    registry: Registry,
    fleet: FleetMetrics,
    tenants: TenantMetrics,
    picks: IntCounterVec,
    refusals: IntCounterVec,
    pick_seconds: Histogram,
    exchanges: IntGauge,
    served: IntCounterVec,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Decision latency buckets: from 20 µs (a round robin pick) to a second (a tokenization
/// through an engine, an adapter load).
const PICK_BUCKETS: [f64; 14] = [
    0.00002, 0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0,
];

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry =
            Registry::new_custom(Some("pd_epp".to_owned()), None).expect("a valid metric prefix");
        let fleet = FleetMetrics::new(&registry);
        let tenants = TenantMetrics::new(&registry);
        let picks = IntCounterVec::new(
            Opts::new(
                "picks_total",
                "Requests placed: through P and D (disaggregated) or to one engine (decode_only), and why",
            ),
            &["decision", "reason"],
        )
        .expect("valid metric");
        let refusals = IntCounterVec::new(
            Opts::new(
                "refusals_total",
                "Requests answered at once instead of routed, by reason (unavailable, model_not_found, bad_request, unauthorized, rate_limited, too_large)",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let pick_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "pick_duration_seconds",
                "Time from a request's complete body to the answer naming its endpoint (tokenization and placement)",
            )
            .buckets(PICK_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        let exchanges = IntGauge::with_opts(Opts::new(
            "exchanges_in_flight",
            "ext_proc streams open (one per request Envoy is processing)",
        ))
        .expect("valid metric");
        let served = IntCounterVec::new(
            Opts::new(
                "served_total",
                "Answers by where the gateway says it sent the request: the endpoint picked, another (its fallback), or not reported",
            ),
            &["endpoint"],
        )
        .expect("valid metric");
        for collector in [
            Box::new(picks.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(refusals.clone()),
            Box::new(pick_seconds.clone()),
            Box::new(exchanges.clone()),
            Box::new(served.clone()),
        ] {
            registry
                .register(collector)
                .expect("metric names are unique");
        }
        pd_service::build_info::register(&registry, "build_info").expect("metric names are unique");
        Metrics {
            registry,
            fleet,
            tenants,
            picks,
            refusals,
            pick_seconds,
            exchanges,
            served,
        }
    }

    /// The fleet's metrics.
    pub fn fleet(&self) -> &FleetMetrics {
        &self.fleet
    }

    /// The tenants' metrics.
    pub fn tenants(&self) -> &TenantMetrics {
        &self.tenants
    }

    /// Counts a pick made in `took`.
    pub fn picked(&self, decision: Decision, took: Duration) {
        (self.picks)
            .with_label_values(&[decision.path_label(), decision.reason_label()])
            .inc();
        self.pick_seconds.observe(took.as_secs_f64());
    }

    /// Counts a request answered at once, for `reason`.
    pub fn refused(&self, reason: &str) {
        self.refusals.with_label_values(&[reason]).inc();
    }

    /// The exchanges open.
    pub fn exchanges(&self) -> &IntGauge {
        &self.exchanges
    }

    /// Counts an answer by where it was served: `picked`, `elsewhere` or `unreported`.
    pub fn served(&self, endpoint: &str) {
        self.served.with_label_values(&[endpoint]).inc();
    }

    /// Renders every metric in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding into a Vec cannot fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}
