//! Prometheus metrics of the proxy, served on `GET /metrics`.
//!
//! Label sets that the hot path touches are resolved once (per backend, per route) so a request
//! only bumps atomics.

mod kv;
mod outcome;
mod tokenize;

use std::time::Duration;

pub use kv::KvMetrics;
pub use outcome::{CallOutcome, Outcome};
pub use tokenize::TokenizeMetrics;

use crate::routing::decision::Decision;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, TextEncoder,
};

/// The metric handles of one backend.
#[derive(Clone)]
pub struct BackendMetrics {
    calls: [IntCounter; CallOutcome::ALL.len()],
    /// Calls to this backend in flight.
    pub in_flight: IntGauge,
    /// 1 when the backend passes its health checks.
    pub healthy: IntGauge,
    /// Requests running and waiting as the engine reports them (-1: not known).
    pub engine_load: IntGauge,
}

impl BackendMetrics {
    /// Counts one finished call.
    pub fn call(&self, outcome: CallOutcome) {
        self.calls[outcome as usize].inc();
    }
}

/// The discovery metric handles of one prefill.
#[derive(Clone)]
pub struct DiscoveryMetrics {
    /// Discovered dp ranks.
    pub dp_ranks: IntGauge,
    /// 1 while the bootstrap server's `/watch` answers; 0 while discovery only polls.
    pub watching: IntGauge,
    /// Discoveries woken by a worker change the bootstrap server's `/watch` reported.
    pub watch_refreshes: IntCounter,
    discoveries_ok: IntCounter,
    discoveries_failed: IntCounter,
}

impl DiscoveryMetrics {
    /// Counts one discovery attempt.
    pub fn discovery(&self, ok: bool) {
        if ok {
            self.discoveries_ok.inc();
        } else {
            self.discoveries_failed.inc();
        }
    }
}

/// The metric handles of one client-facing route.
#[derive(Clone)]
pub struct RouteMetrics {
    outcomes: [IntCounter; Outcome::ALL.len()],
    duration: Histogram,
    ttft: Histogram,
    overhead: Histogram,
    in_flight: IntGauge,
    retries: IntCounter,
    engine_reroutes: IntCounter,
    prefill: Histogram,
    decode_first_byte: Histogram,
}

impl RouteMetrics {
    /// Counts a request as started.
    pub fn start(&self) {
        self.in_flight.inc();
    }

    /// Counts a request as finished.
    pub fn finish(&self, outcome: Outcome, elapsed: Duration) {
        self.in_flight.dec();
        self.outcomes[outcome as usize].inc();
        self.duration.observe(elapsed.as_secs_f64());
    }

    /// Records the time from the request's arrival to D's first byte.
    pub fn first_byte(&self, elapsed: Duration) {
        self.ttft.observe(elapsed.as_secs_f64());
    }

    /// Records the proxy's own time on a request (see the metric's help).
    pub fn overhead(&self, elapsed: Duration) {
        self.overhead.observe(elapsed.as_secs_f64());
    }

    /// Counts one retry of D on another decode.
    pub fn retry(&self) {
        self.retries.inc();
    }

    /// Counts one call of D made again with the new engine id of a re-registered prefill.
    pub fn engine_reroute(&self) {
        self.engine_reroutes.inc();
    }

    /// Records how long P took to answer (its whole call).
    pub fn prefill_answered(&self, elapsed: Duration) {
        self.prefill.observe(elapsed.as_secs_f64());
    }

    /// Records the time from D's call being issued to its first byte.
    pub fn decode_first_byte(&self, elapsed: Duration) {
        self.decode_first_byte.observe(elapsed.as_secs_f64());
    }
}

/// The routing decision counters, one per possible decision.
#[derive(Clone)]
pub struct DecisionMetrics([IntCounter; Decision::ALL.len()]);

impl DecisionMetrics {
    /// Counts one decision.
    pub fn count(&self, decision: Decision) {
        self.0[decision.slot()].inc();
    }
}

/// Every metric the proxy exports, in its own registry.
pub struct Metrics {
    registry: prometheus::Registry,
    kv: KvMetrics,
    tokenize: TokenizeMetrics,
    requests: IntCounterVec,
    duration: HistogramVec,
    ttft: HistogramVec,
    overhead: HistogramVec,
    in_flight: IntGaugeVec,
    retries: IntCounterVec,
    engine_reroutes: IntCounterVec,
    prefill: HistogramVec,
    decode_first_byte: HistogramVec,
    calls: IntCounterVec,
    backend_in_flight: IntGaugeVec,
    healthy: IntGaugeVec,
    engine_load: IntGaugeVec,
    dp_ranks: IntGaugeVec,
    discoveries: IntCounterVec,
    watching: IntGaugeVec,
    watch_refreshes: IntCounterVec,
    decisions: IntCounterVec,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

const LATENCY_BUCKETS: &[f64] = &[
    0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0,
];

const OVERHEAD_BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
];

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = prometheus::Registry::new();
        let route = &["route"];
        let requests = IntCounterVec::new(
            Opts::new(
                "pd_proxy_requests_total",
                "Client requests by route and outcome",
            ),
            &["route", "outcome"],
        )
        .expect("valid metric");
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "pd_proxy_request_duration_seconds",
                "Time from a client request's arrival to the end of its answer",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            route,
        )
        .expect("valid metric");
        let ttft = HistogramVec::new(
            HistogramOpts::new(
                "pd_proxy_time_to_first_byte_seconds",
                "Time from a client request's arrival to the first byte of D's answer (TTFT when streaming)",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            route,
        )
        .expect("valid metric");
        let overhead = HistogramVec::new(
            HistogramOpts::new(
                "pd_proxy_overhead_seconds",
                "The proxy's own time per request: from the request's arrival until D's call is issued, plus from D's first byte until the answer is handed to the client",
            )
            .buckets(OVERHEAD_BUCKETS.to_vec()),
            route,
        )
        .expect("valid metric");
        let prefill = HistogramVec::new(
            HistogramOpts::new(
                "pd_proxy_prefill_duration_seconds",
                "Time P took to answer (its whole call: the prompt's computation and KV publication)",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            route,
        )
        .expect("valid metric");
        let decode_first_byte = HistogramVec::new(
            HistogramOpts::new(
                "pd_proxy_decode_first_byte_seconds",
                "Time from D's call being issued to its first byte (D's wait for the KV included)",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            route,
        )
        .expect("valid metric");
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "pd_proxy_requests_in_flight",
                "Client requests being served",
            ),
            route,
        )
        .expect("valid metric");
        let retries = IntCounterVec::new(
            Opts::new(
                "pd_proxy_decode_retries_total",
                "Requests retried on another decode after D failed before its first byte",
            ),
            route,
        )
        .expect("valid metric");
        let engine_reroutes = IntCounterVec::new(
            Opts::new(
                "pd_proxy_engine_reroutes_total",
                "Requests whose D was asked again with the new engine id of a prefill that \
                 re-registered (D could not find the engine it was told)",
            ),
            route,
        )
        .expect("valid metric");
        let calls = IntCounterVec::new(
            Opts::new(
                "pd_proxy_backend_requests_total",
                "Calls to backends by role, backend and outcome",
            ),
            &["role", "backend", "outcome"],
        )
        .expect("valid metric");
        let backend_in_flight = IntGaugeVec::new(
            Opts::new("pd_proxy_backend_in_flight", "Calls to a backend in flight"),
            &["role", "backend"],
        )
        .expect("valid metric");
        let healthy = IntGaugeVec::new(
            Opts::new(
                "pd_proxy_backend_healthy",
                "1 when a backend passes its health checks, 0 otherwise",
            ),
            &["role", "backend"],
        )
        .expect("valid metric");
        let engine_load = IntGaugeVec::new(
            Opts::new(
                "pd_proxy_backend_engine_load",
                "Requests running and waiting as a backend's engine reports them on its /metrics (-1: not known)",
            ),
            &["role", "backend"],
        )
        .expect("valid metric");
        let dp_ranks = IntGaugeVec::new(
            Opts::new(
                "pd_proxy_prefill_dp_ranks",
                "dp ranks discovered on a prefill's bootstrap server",
            ),
            &["backend"],
        )
        .expect("valid metric");
        let discoveries = IntCounterVec::new(
            Opts::new(
                "pd_proxy_discoveries_total",
                "Discovery attempts (/health then /query) by prefill and outcome",
            ),
            &["backend", "outcome"],
        )
        .expect("valid metric");
        let watching = IntGaugeVec::new(
            Opts::new(
                "pd_proxy_discovery_watching",
                "1 while a prefill's bootstrap server reports worker changes through /watch, 0 while discovery only polls it",
            ),
            &["backend"],
        )
        .expect("valid metric");
        let watch_refreshes = IntCounterVec::new(
            Opts::new(
                "pd_proxy_discovery_watch_refreshes_total",
                "Discoveries woken by a worker change a prefill's bootstrap server reported through /watch",
            ),
            &["backend"],
        )
        .expect("valid metric");
        let decisions = IntCounterVec::new(
            Opts::new(
                "pd_proxy_route_decisions_total",
                "Routing decisions: through P and D (disaggregated), to a decode alone (decode_only) or refused, and why",
            ),
            &["decision", "reason"],
        )
        .expect("valid metric");
        for collector in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(decisions.clone()),
            Box::new(duration.clone()),
            Box::new(ttft.clone()),
            Box::new(overhead.clone()),
            Box::new(in_flight.clone()),
            Box::new(retries.clone()),
            Box::new(engine_reroutes.clone()),
            Box::new(prefill.clone()),
            Box::new(decode_first_byte.clone()),
            Box::new(calls.clone()),
            Box::new(backend_in_flight.clone()),
            Box::new(healthy.clone()),
            Box::new(engine_load.clone()),
            Box::new(dp_ranks.clone()),
            Box::new(discoveries.clone()),
            Box::new(watching.clone()),
            Box::new(watch_refreshes.clone()),
        ] {
            registry
                .register(collector)
                .expect("metric names are unique");
        }
        let kv = KvMetrics::new(&registry);
        let tokenize = TokenizeMetrics::new(&registry);
        Metrics {
            registry,
            kv,
            tokenize,
            requests,
            duration,
            ttft,
            overhead,
            in_flight,
            retries,
            engine_reroutes,
            prefill,
            decode_first_byte,
            calls,
            backend_in_flight,
            healthy,
            engine_load,
            dp_ranks,
            discoveries,
            watching,
            watch_refreshes,
            decisions,
        }
    }

    /// The routing decision counters.
    pub fn decisions(&self) -> DecisionMetrics {
        DecisionMetrics(Decision::ALL.map(|d| {
            self.decisions
                .with_label_values(&[d.path_label(), d.reason_label()])
        }))
    }

    /// The KV-event index's handles.
    pub fn kv(&self) -> KvMetrics {
        self.kv.clone()
    }

    /// The tokenization handles.
    pub fn tokenize(&self) -> TokenizeMetrics {
        self.tokenize.clone()
    }

    /// The handles of one route.
    pub fn route(&self, route: &str) -> RouteMetrics {
        RouteMetrics {
            outcomes: Outcome::ALL.map(|o| self.requests.with_label_values(&[route, o.as_str()])),
            duration: self.duration.with_label_values(&[route]),
            ttft: self.ttft.with_label_values(&[route]),
            overhead: self.overhead.with_label_values(&[route]),
            in_flight: self.in_flight.with_label_values(&[route]),
            retries: self.retries.with_label_values(&[route]),
            engine_reroutes: self.engine_reroutes.with_label_values(&[route]),
            prefill: self.prefill.with_label_values(&[route]),
            decode_first_byte: self.decode_first_byte.with_label_values(&[route]),
        }
    }

    /// The handles of one backend (`role` is `prefill` or `decode`).
    pub fn backend(&self, role: &str, url: &str) -> BackendMetrics {
        BackendMetrics {
            calls: CallOutcome::ALL.map(|o| self.calls.with_label_values(&[role, url, o.as_str()])),
            in_flight: self.backend_in_flight.with_label_values(&[role, url]),
            healthy: self.healthy.with_label_values(&[role, url]),
            engine_load: {
                let gauge = self.engine_load.with_label_values(&[role, url]);
                gauge.set(-1);
                gauge
            },
        }
    }

    /// The discovery handles of one prefill.
    pub fn discovery(&self, url: &str) -> DiscoveryMetrics {
        DiscoveryMetrics {
            dp_ranks: self.dp_ranks.with_label_values(&[url]),
            watching: self.watching.with_label_values(&[url]),
            watch_refreshes: self.watch_refreshes.with_label_values(&[url]),
            discoveries_ok: self.discoveries.with_label_values(&[url, "ok"]),
            discoveries_failed: self.discoveries.with_label_values(&[url, "error"]),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The dashboard under docs/ queries only metrics the proxy exports.
    #[test]
    fn the_grafana_dashboard_names_real_metrics() {
        let metrics = Metrics::new();
        let route = metrics.route("/v1/completions");
        route.prefill_answered(Duration::from_millis(1));
        route.decode_first_byte(Duration::from_millis(1));
        route.first_byte(Duration::from_millis(1));
        route.overhead(Duration::from_millis(1));
        route.finish(Outcome::Ok, Duration::from_millis(1));
        route.retry();
        metrics
            .backend("prefill", "http://p:1")
            .call(CallOutcome::Ok);
        metrics.decisions().count(Decision::ALL[0]);
        let rendered = metrics.render();
        let dashboard = include_str!("../../../docs/grafana/pd-proxy.json");
        match pd_service::check_dashboard(dashboard, "pd_proxy_", &rendered) {
            Ok(checked) => assert!(checked >= 8, "only {checked} metrics named"),
            Err(missing) => panic!("the dashboard queries {missing:?}, not exported"),
        }
    }
}
