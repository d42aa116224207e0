//! The fleet's Prometheus metrics: each backend's calls, load and health, each prefill's
//! discovery, the DNS names, the KV-event index, tokenization, adapter loads, the admission
//! under overload, the latency predictions and the capacity planner. They are
//! registered in the registry of the process that runs the router, whose prefix names them
//! (`pd_proxy_backend_requests_total` in pd-proxy, `pd_epp_...` in pd-epp), so one
//! `GET /metrics` shows them beside the front door's own.
//!
//! Label sets that the hot path touches are resolved once (per backend) so a request only
//! bumps atomics.

mod admission;
mod dns;
mod duty;
mod kv;
mod latency;
mod lora;
mod outcome;
mod planner;
mod tokenize;
mod versions;

pub use admission::AdmissionMetrics;
pub use dns::DnsMetrics;
pub use duty::DutyMetrics;
pub use kv::KvMetrics;
pub use latency::{LatencyKind, LatencyMetrics};
pub use lora::{LoadOutcome, LoraMetrics};
pub use outcome::CallOutcome;
pub use planner::PlannerMetrics;
pub use tokenize::TokenizeMetrics;
pub use versions::VersionMetrics;

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

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
    /// 1 while the engine is saturated (its waiting requests, KV cache, requests in flight, or
    /// silence past a threshold).
    pub saturated: IntGauge,
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

/// The fleet's metric families, registered in one registry.
#[derive(Clone)]
pub struct FleetMetrics {
    admission: AdmissionMetrics,
    latency: LatencyMetrics,
    planner: PlannerMetrics,
    duty: DutyMetrics,
    kv: KvMetrics,
    tokenize: TokenizeMetrics,
    lora: LoraMetrics,
    dns: DnsMetrics,
    versions: VersionMetrics,
    calls: IntCounterVec,
    backend_in_flight: IntGaugeVec,
    healthy: IntGaugeVec,
    engine_load: IntGaugeVec,
    saturated: IntGaugeVec,
    dp_ranks: IntGaugeVec,
    discoveries: IntCounterVec,
    watching: IntGaugeVec,
    watch_refreshes: IntCounterVec,
}

impl FleetMetrics {
    /// Creates the families and registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let calls = IntCounterVec::new(
            Opts::new(
                "backend_requests_total",
                "Calls to backends by role, backend and outcome",
            ),
            &["role", "backend", "outcome"],
        )
        .expect("valid metric");
        let backend_in_flight = IntGaugeVec::new(
            Opts::new("backend_in_flight", "Calls to a backend in flight"),
            &["role", "backend"],
        )
        .expect("valid metric");
        let healthy = IntGaugeVec::new(
            Opts::new(
                "backend_healthy",
                "1 when a backend passes its health checks, 0 otherwise",
            ),
            &["role", "backend"],
        )
        .expect("valid metric");
        let engine_load = IntGaugeVec::new(
            Opts::new(
                "backend_engine_load",
                "Requests running and waiting as a backend's engine reports them on its /metrics (-1: not known)",
            ),
            &["role", "backend"],
        )
        .expect("valid metric");
        let saturated = IntGaugeVec::new(
            Opts::new(
                "backend_saturated",
                "1 while a backend's engine is saturated: requests waiting or KV cache usage past --saturation-waiting or --saturation-kv-usage, requests in flight past --saturation-in-flight, or its metrics silent past three intervals",
            ),
            &["role", "backend"],
        )
        .expect("valid metric");
        let dp_ranks = IntGaugeVec::new(
            Opts::new(
                "prefill_dp_ranks",
                "dp ranks discovered on a prefill's bootstrap server",
            ),
            &["backend"],
        )
        .expect("valid metric");
        let discoveries = IntCounterVec::new(
            Opts::new(
                "discoveries_total",
                "Discovery attempts (/health then /query) by prefill and outcome",
            ),
            &["backend", "outcome"],
        )
        .expect("valid metric");
        let watching = IntGaugeVec::new(
            Opts::new(
                "discovery_watching",
                "1 while a prefill's bootstrap server reports worker changes through /watch, 0 while discovery only polls it",
            ),
            &["backend"],
        )
        .expect("valid metric");
        let watch_refreshes = IntCounterVec::new(
            Opts::new(
                "discovery_watch_refreshes_total",
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
            Box::new(saturated.clone()),
            Box::new(dp_ranks.clone()),
            Box::new(discoveries.clone()),
            Box::new(watching.clone()),
            Box::new(watch_refreshes.clone()),
        ] {
            registry
                .register(collector)
                .expect("metric names are unique");
        }
        let kv = KvMetrics::new(registry);
        let tokenize = TokenizeMetrics::new(registry);
        let lora = LoraMetrics::new(registry);
        let dns = DnsMetrics::new(registry);
        let versions = VersionMetrics::new(registry);
        FleetMetrics {
            admission: AdmissionMetrics::new(registry),
            latency: LatencyMetrics::new(registry),
            planner: PlannerMetrics::new(registry),
            duty: DutyMetrics::new(registry),
            kv,
            tokenize,
            lora,
            dns,
            versions,
            calls,
            backend_in_flight,
            healthy,
            engine_load,
            saturated,
            dp_ranks,
            discoveries,
            watching,
            watch_refreshes,
        }
    }

    /// The admission's and retry budget's handles.
    pub fn admission(&self) -> AdmissionMetrics {
        self.admission.clone()
    }

    /// The latency predictions' handles.
    pub fn latency(&self) -> LatencyMetrics {
        self.latency.clone()
    }

    /// The capacity planner's handles.
    pub fn planner(&self) -> PlannerMetrics {
        self.planner.clone()
    }

    /// The duties' handles (`--dual`).
    pub fn duty(&self) -> DutyMetrics {
        self.duty.clone()
    }

    /// The KV-event index's handles.
    pub fn kv(&self) -> KvMetrics {
        self.kv.clone()
    }

    /// The DNS discovery handles.
    pub fn dns(&self) -> DnsMetrics {
        self.dns.clone()
    }

    /// The engine version metric's handle.
    pub fn versions(&self) -> VersionMetrics {
        self.versions.clone()
    }

    /// The adapter-load handles.
    pub fn lora(&self) -> LoraMetrics {
        self.lora.clone()
    }

    /// The tokenization handles.
    pub fn tokenize(&self) -> TokenizeMetrics {
        self.tokenize.clone()
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
            saturated: self.saturated.with_label_values(&[role, url]),
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
        for family in [
            &self.backend_in_flight,
            &self.healthy,
            &self.engine_load,
            &self.saturated,
        ] {
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
}
