//! Prometheus metrics of the proxy, served on `GET /metrics`: the requests of each route and
//! model (here) beside the fleet's (the router's [`FleetMetrics`]), in one registry.
//!
//! Label sets that the hot path touches are resolved once (per backend, per route) so a request
//! only bumps atomics.

mod migration;
mod outcome;
mod route;
mod summary;

pub(crate) use migration::{Break, Migrated, MigrationMetrics};
pub(crate) use outcome::Outcome;
pub(crate) use pd_router::metrics::{CallOutcome, FleetMetrics};
pub(crate) use pd_router::tenants::metrics::TenantMetrics;
pub(crate) use route::{DecisionMetrics, RouteMetrics};
pub(crate) use summary::Gathered;

use route::RouteFamilies;

use prometheus::{Encoder, TextEncoder};

/// Every metric the proxy exports, in its own registry.
pub(crate) struct Metrics {
    registry: prometheus::Registry,
    fleet: FleetMetrics,
    routes: RouteFamilies,
    migrations: MigrationMetrics,
    tenants: TenantMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub(crate) fn new() -> Self {
        let registry = prometheus::Registry::new_custom(Some("pd_proxy".to_owned()), None)
            .expect("a valid metric prefix");
        let fleet = FleetMetrics::new(&registry);
        let routes = RouteFamilies::new(&registry);
        let migrations = MigrationMetrics::new(&registry);
        let tenants = TenantMetrics::new(&registry);
        pd_service::build_info::register(&registry, "build_info").expect("metric names are unique");
        Metrics {
            registry,
            fleet,
            routes,
            migrations,
            tenants,
        }
    }

    /// The fleet's metrics (backends, discovery, KV events, tokenization, adapters, DNS).
    pub(crate) fn fleet(&self) -> &FleetMetrics {
        &self.fleet
    }

    /// The metrics of answers continued on another decode.
    pub(crate) fn migrations(&self) -> &MigrationMetrics {
        &self.migrations
    }

    /// The tenants' metrics.
    pub(crate) fn tenants(&self) -> &TenantMetrics {
        &self.tenants
    }

    /// The routing decision counters of requests for `model` (a label value: see
    /// [`crate::models::ModelLabels`]).
    pub(crate) fn decisions(&self, model: &str) -> DecisionMetrics {
        self.routes.decisions(model)
    }

    /// The handles of one route, for requests for `model` (a label value: see
    /// [`crate::models::ModelLabels`]).
    pub(crate) fn route(&self, route: &str, model: &str) -> RouteMetrics {
        self.routes.route(route, model)
    }

    /// One reading of every metric, to summarize (the live page reads several families of the
    /// same instant).
    pub(crate) fn gather(&self) -> Gathered {
        Gathered::new(self.registry.gather())
    }

    /// Renders every metric in the Prometheus text format.
    pub(crate) fn render(&self) -> String {
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

    #[test]
    fn request_series_appear_once_used() {
        let metrics = Metrics::new();
        let generate = metrics.route("/generate", "m");
        let completions = metrics.route("/v1/completions", "m");
        let decisions = metrics.decisions("m");
        let fresh = metrics.render();
        assert!(!fresh.contains("route=\"/generate\""), "{fresh}");
        assert!(!fresh.contains("pd_proxy_requests_total"), "{fresh}");
        assert!(!fresh.contains("pd_proxy_route_decisions_total"), "{fresh}");
        assert!(fresh.contains("pd_proxy_build_info{commit="), "{fresh}");
        completions.start();
        completions.finish(Outcome::BadRequest, Duration::from_millis(1));
        decisions.count(pd_router::routing::decision::Decision::ALL[0]);
        let used = metrics.render();
        assert!(used.contains(
            r#"pd_proxy_requests_total{model="m",outcome="bad_request",route="/v1/completions"} 1"#
        ));
        // Every outcome of the route used, at 0 but the one that happened (so that rate()
        // sees an outcome's first burst), and still nothing of the route never called.
        assert!(used.contains(
            r#"pd_proxy_requests_total{model="m",outcome="decode_error",route="/v1/completions"} 0"#
        ));
        assert_eq!(
            used.matches("pd_proxy_requests_total{").count(),
            Outcome::ALL.len(),
            "{used}"
        );
        assert_eq!(
            used.matches("pd_proxy_route_decisions_total{").count(),
            1,
            "{used}"
        );
        assert!(!used.contains("route=\"/generate\""), "{used}");
        drop(generate);
    }

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
            .fleet()
            .backend("prefill", "http://p:1")
            .call(CallOutcome::Ok);
        metrics
            .decisions("m")
            .count(pd_router::routing::decision::Decision::ALL[0]);
        // The router's admission shows its refusal reasons from the start.
        metrics.fleet().admission().shed_reason("sheddable");
        let latency = metrics.fleet().latency();
        latency.observed(pd_router::latency::Kind::Ttft, Duration::ZERO, None);
        // A keyed proxy's tenants have their series from the start.
        metrics.tenants().known("t");
        let rendered = metrics.render();
        let dashboard = include_str!("../../../docs/grafana/pd-proxy.json");
        match pd_service::check_dashboard(dashboard, "pd_proxy_", &rendered) {
            Ok(checked) => assert!(checked >= 8, "only {checked} metrics named"),
            Err(missing) => panic!("the dashboard queries {missing:?}, not exported"),
        }
    }
}
