//! Prometheus metrics of the proxy, served on `GET /metrics`.
//!
//! Label sets that the hot path touches are resolved once (per backend, per route) so a request
//! only bumps atomics.

mod dns;
mod kv;
mod lora;
mod outcome;
mod route;
mod tokenize;

pub use dns::DnsMetrics;
pub use kv::KvMetrics;
pub use lora::{LoadOutcome, LoraMetrics};
pub use outcome::{CallOutcome, Outcome};
pub use route::{DecisionMetrics, RouteMetrics};
pub use tokenize::TokenizeMetrics;

use route::RouteFamilies;

use prometheus::{Encoder, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, TextEncoder};

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

/// Every metric the proxy exports, in its own registry.
pub struct Metrics {
    registry: prometheus::Registry,
    kv: KvMetrics,
    tokenize: TokenizeMetrics,
    lora: LoraMetrics,
    dns: DnsMetrics,
    routes: RouteFamilies,
    calls: IntCounterVec,
    backend_in_flight: IntGaugeVec,
    healthy: IntGaugeVec,
    engine_load: IntGaugeVec,
    dp_ranks: IntGaugeVec,
    discoveries: IntCounterVec,
    watching: IntGaugeVec,
    watch_refreshes: IntCounterVec,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = prometheus::Registry::new();
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
        for collector in [
            Box::new(calls.clone()) as Box<dyn prometheus::core::Collector>,
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
        let routes = RouteFamilies::new(&registry);
        let lora = LoraMetrics::new(&registry);
        let dns = DnsMetrics::new(&registry);
        Metrics {
            registry,
            kv,
            tokenize,
            lora,
            dns,
            routes,
            calls,
            backend_in_flight,
            healthy,
            engine_load,
            dp_ranks,
            discoveries,
            watching,
            watch_refreshes,
        }
    }

    /// The routing decision counters of requests for `model` (a label value: see
    /// [`crate::models::ModelLabels`]).
    pub fn decisions(&self, model: &str) -> DecisionMetrics {
        self.routes.decisions(model)
    }

    /// The KV-event index's handles.
    pub fn kv(&self) -> KvMetrics {
        self.kv.clone()
    }

    /// The DNS discovery handles.
    pub fn dns(&self) -> DnsMetrics {
        self.dns.clone()
    }

    /// The adapter-load handles.
    pub fn lora(&self) -> LoraMetrics {
        self.lora.clone()
    }

    /// The tokenization handles.
    pub fn tokenize(&self) -> TokenizeMetrics {
        self.tokenize.clone()
    }

    /// The handles of one route, for requests for `model` (a label value: see
    /// [`crate::models::ModelLabels`]).
    pub fn route(&self, route: &str, model: &str) -> RouteMetrics {
        self.routes.route(route, model)
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

    /// Drops the series of the `role` backend at `url` (it left the pool), so that backends
    /// coming and going do not grow the metrics without bound.
    pub fn forget_backend(&self, role: &str, url: &str) {
        for outcome in CallOutcome::ALL {
            let _ = self
                .calls
                .remove_label_values(&[role, url, outcome.as_str()]);
        }
        for family in [&self.backend_in_flight, &self.healthy, &self.engine_load] {
            let _ = family.remove_label_values(&[role, url]);
        }
        if role == "prefill" {
            for family in [&self.dp_ranks, &self.watching] {
                let _ = family.remove_label_values(&[url]);
            }
            let _ = self.watch_refreshes.remove_label_values(&[url]);
            for outcome in ["ok", "error"] {
                let _ = self.discoveries.remove_label_values(&[url, outcome]);
            }
        }
    }

    /// The counter `family`'s values summed by the `labels` given (over every other label),
    /// the largest first: e.g. the routing decisions by decision and reason, for the live page.
    pub fn totals_by(&self, family: &str, labels: &[&str]) -> Vec<(Vec<String>, u64)> {
        let mut totals: std::collections::BTreeMap<Vec<String>, f64> = Default::default();
        let gathered = self.registry.gather();
        for metric in gathered
            .iter()
            .filter(|f| f.name() == family)
            .flat_map(|f| f.get_metric())
        {
            let key = (labels.iter())
                .map(|name| {
                    let pair = metric.get_label().iter().find(|pair| pair.name() == *name);
                    pair.map(|pair| pair.value().to_owned()).unwrap_or_default()
                })
                .collect();
            *totals.entry(key).or_default() += metric.get_counter().get_value();
        }
        let mut totals: Vec<(Vec<String>, u64)> = (totals.into_iter())
            .filter(|(_, value)| *value > 0.0)
            .map(|(key, value)| (key, value as u64))
            .collect();
        totals.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        totals
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
    use std::time::Duration;

    /// The dashboard under docs/ queries only metrics the proxy exports.
    #[test]
    fn the_grafana_dashboard_names_real_metrics() {
        let metrics = Metrics::new();
        let route = metrics.route("/v1/completions", "m");
        route.prefill_answered(Duration::from_millis(1));
        route.decode_first_byte(Duration::from_millis(1));
        route.first_byte(Duration::from_millis(1));
        route.overhead(Duration::from_millis(1));
        route.finish(Outcome::Ok, Duration::from_millis(1));
        route.retry();
        metrics
            .backend("prefill", "http://p:1")
            .call(CallOutcome::Ok);
        metrics
            .decisions("m")
            .count(crate::routing::decision::Decision::ALL[0]);
        let rendered = metrics.render();
        let dashboard = include_str!("../../../docs/grafana/pd-proxy.json");
        match pd_service::check_dashboard(dashboard, "pd_proxy_", &rendered) {
            Ok(checked) => assert!(checked >= 8, "only {checked} metrics named"),
            Err(missing) => panic!("the dashboard queries {missing:?}, not exported"),
        }
    }
}
