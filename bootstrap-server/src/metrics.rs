//! Prometheus metrics of the bootstrap server.

use std::time::Duration;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, TextEncoder,
};

use crate::registry::{RegisterOutcome, Stats, WriteStats};

/// Every metric the server exports, registered in its own Prometheus registry.
pub struct Metrics {
    registry: prometheus::Registry,
    http_requests: IntCounterVec,
    http_duration: HistogramVec,
    request_lookups: IntCounterVec,
    pruned_requests: IntCounter,
    engine_takeovers: IntCounter,
    registrations: IntCounterVec,
    writes_unprotected: IntGauge,
    workers: IntGauge,
    engines: IntGauge,
    live_requests: IntGauge,
    topology_revision: IntGauge,
    store_connected: IntGauge,
    topology_ready: IntGauge,
    topology_expected: IntGauge,
    topology_missing: IntGauge,
    lease_removals: IntCounter,
    catching_up: std::sync::Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric of the server's own (the registry writer's are
    /// added by [`Metrics::export_writes`]).
    pub fn new() -> Self {
        let registry = prometheus::Registry::new();
        let http_requests = IntCounterVec::new(
            Opts::new(
                "bootstrap_http_requests_total",
                "HTTP requests by route, method and status code",
            ),
            &["route", "method", "status"],
        )
        .expect("valid metric");
        let http_duration = HistogramVec::new(
            HistogramOpts::new(
                "bootstrap_http_request_duration_seconds",
                "Time to answer an HTTP request, by route",
            )
            .buckets(vec![
                0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25, 1.0,
            ]),
            &["route"],
        )
        .expect("valid metric");
        let request_lookups = IntCounterVec::new(
            Opts::new(
                "bootstrap_request_lookups_total",
                "Request ids resolved by /query_requests, by result (ok, retry, error)",
            ),
            &["result"],
        )
        .expect("valid metric");
        let pruned_requests = IntCounter::new(
            "bootstrap_pruned_requests_total",
            "Request ids removed because their TTL expired",
        )
        .expect("valid metric");
        let engine_takeovers = IntCounter::new(
            "bootstrap_engine_takeovers_total",
            "Registrations that took a slot over from another engine, or from the same engine at another address (a restart); the old engine's workers left with it",
        )
        .expect("valid metric");
        let registrations = IntCounterVec::new(
            Opts::new(
                "bootstrap_registrations_total",
                "Registrations accepted, by wire dialect (vllm, sglang) and outcome (created, replayed, renewed, taken_over)",
            ),
            &["dialect", "outcome"],
        )
        .expect("valid metric");
        let writes_unprotected = IntGauge::new(
            "bootstrap_writes_unprotected",
            "1 when the server listens beyond loopback with neither --auth-token nor --allow-writes-from: anyone who reaches the port can register",
        )
        .expect("valid metric");
        let workers =
            IntGauge::new("bootstrap_workers", "Registered worker slots").expect("valid metric");
        let engines = IntGauge::new("bootstrap_engines", "Engines owning at least one dp rank")
            .expect("valid metric");
        let live_requests =
            IntGauge::new("bootstrap_live_requests", "Request ids in the request map")
                .expect("valid metric");
        let topology_revision = IntGauge::new(
            "bootstrap_topology_revision",
            "Revision of the registry's worker table (the one GET /workers reports)",
        )
        .expect("valid metric");
        let store_connected = IntGauge::new(
            "bootstrap_store_connected",
            "1 while the store follows every change (always with sled; with etcd while its watch is up)",
        )
        .expect("valid metric");
        let topology_ready = IntGauge::new(
            "bootstrap_topology_ready",
            "1 when every worker of the configured topology (--dp-size, --tp-size, --pp-size) is registered, as GET /ready says; 1 without a configured topology",
        )
        .expect("valid metric");
        let topology_expected = IntGauge::new(
            "bootstrap_topology_expected_workers",
            "Workers the configured topology expects (0 without one)",
        )
        .expect("valid metric");
        let topology_missing = IntGauge::new(
            "bootstrap_topology_missing_workers",
            "Expected workers not registered yet",
        )
        .expect("valid metric");
        let lease_removals = IntCounter::new(
            "bootstrap_lease_removed_workers_total",
            "Workers removed because their lease ended: expired (the holder stopped its keepalives) or revoked (DELETE /leases/{id}, a clean stop)",
        )
        .expect("valid metric");
        for collector in [
            Box::new(http_requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(http_duration.clone()),
            Box::new(request_lookups.clone()),
            Box::new(pruned_requests.clone()),
            Box::new(engine_takeovers.clone()),
            Box::new(registrations.clone()),
            Box::new(writes_unprotected.clone()),
            Box::new(workers.clone()),
            Box::new(engines.clone()),
            Box::new(live_requests.clone()),
            Box::new(topology_revision.clone()),
            Box::new(store_connected.clone()),
            Box::new(topology_ready.clone()),
            Box::new(topology_expected.clone()),
            Box::new(topology_missing.clone()),
            Box::new(lease_removals.clone()),
        ] {
            registry
                .register(collector)
                .expect("metric names are unique");
        }
        pd_service::build_info::register(&registry, "bootstrap_build_info")
            .expect("metric names are unique");
        Metrics {
            registry,
            http_requests,
            http_duration,
            request_lookups,
            pruned_requests,
            engine_takeovers,
            registrations,
            writes_unprotected,
            workers,
            engines,
            live_requests,
            topology_revision,
            store_connected,
            topology_ready,
            topology_expected,
            topology_missing,
            lease_removals,
            catching_up: std::sync::Mutex::new(()),
        }
    }

    /// Counts one answered HTTP request.
    pub fn observe_http(&self, route: &str, method: &str, status: &str, elapsed: Duration) {
        self.http_requests
            .with_label_values(&[route, method, status])
            .inc();
        self.http_duration
            .with_label_values(&[route])
            .observe(elapsed.as_secs_f64());
    }

    /// Counts the results of one `/query_requests` call.
    pub fn observe_lookups(&self, ok: u64, retry: u64, error: u64) {
        for (result, count) in [("ok", ok), ("retry", retry), ("error", error)] {
            if count > 0 {
                self.request_lookups
                    .with_label_values(&[result])
                    .inc_by(count);
            }
        }
    }

    /// Counts one accepted registration of `dialect` (and a takeover among them).
    pub fn observe_registration(&self, dialect: &str, outcome: &RegisterOutcome) {
        let label = match outcome {
            RegisterOutcome::Created => "created",
            RegisterOutcome::Replayed => "replayed",
            RegisterOutcome::Renewed => "renewed",
            RegisterOutcome::TakenOver { .. } => {
                self.engine_takeovers.inc();
                "taken_over"
            }
        };
        self.registrations
            .with_label_values(&[dialect, label])
            .inc();
    }

    /// Exports the registry writer's histograms (see [`WriteStats`]) with the rest.
    pub fn export_writes(&self, stats: &WriteStats) {
        for collector in stats.collectors() {
            self.registry
                .register(collector)
                .expect("metric names are unique");
        }
    }

    /// Says whether writes are open to anyone who reaches the port.
    pub fn set_writes_unprotected(&self, unprotected: bool) {
        self.writes_unprotected.set(i64::from(unprotected));
    }

    /// Counts request ids removed by expiry.
    pub fn observe_pruned(&self, count: usize) {
        self.pruned_requests.inc_by(count as u64);
    }

    /// Renders every metric in the Prometheus text format, with gauges taken from `stats`.
    pub fn render(&self, stats: Stats) -> String {
        self.workers.set(stats.workers as i64);
        self.engines.set(stats.engines as i64);
        self.live_requests.set(stats.live_requests as i64);
        self.topology_revision.set(stats.revision as i64);
        self.store_connected.set(i64::from(stats.store_connected));
        let readiness = &stats.readiness;
        self.topology_ready
            .set(i64::from(!readiness.is_incomplete()));
        self.topology_expected
            .set(readiness.expected.unwrap_or(0) as i64);
        self.topology_missing.set(readiness.missing as i64);
        {
            // The registry counts; the counter catches up, one render at a time so that two
            // cannot both add the same difference.
            let _one = crate::sync::lock(&self.catching_up);
            let behind = stats
                .lease_removals
                .saturating_sub(self.lease_removals.get());
            self.lease_removals.inc_by(behind);
        }
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding into a Vec cannot fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}
