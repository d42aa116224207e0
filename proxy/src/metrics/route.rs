//! The metrics of client requests, by route and by model: outcomes, latencies, the phases (P's
//! answer, D's first byte), retries, and the routing decisions.
//!
//! A series is created the first time it counts something ([`Series`]): a scrape shows what
//! happened, not every route and model that could (a proxy in vLLM mode never shows
//! `/generate`), while a request still holds its handles and looks no label up. The outcome
//! counters of a route and model are the exception: all of them appear, at 0, with its first
//! request, so that `rate()` over an outcome (an error-ratio alert) counts its first burst
//! instead of taking it as where the series began.

use std::sync::OnceLock;
use std::time::Duration;

use prometheus::core::{MetricVec, MetricVecBuilder};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use super::Outcome;
use pd_router::routing::decision::Decision;

const LATENCY_BUCKETS: &[f64] = &[
    0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0,
];

const OVERHEAD_BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
];

/// One series of a family, created in it the first time it is used.
struct Series<B: MetricVecBuilder> {
    family: MetricVec<B>,
    labels: Box<[String]>,
    handle: OnceLock<B::M>,
}

impl<B: MetricVecBuilder> Series<B> {
    fn new(family: &MetricVec<B>, labels: &[&str]) -> Self {
        Series {
            family: family.clone(),
            labels: labels.iter().map(|label| (*label).to_owned()).collect(),
            handle: OnceLock::new(),
        }
    }

    /// The series, created now if it was not.
    fn get(&self) -> &B::M {
        self.handle.get_or_init(|| {
            let labels: Vec<&str> = self.labels.iter().map(String::as_str).collect();
            self.family.with_label_values(&labels)
        })
    }
}

type CounterSeries = Series<<IntCounterVec as VecOf>::Builder>;
type GaugeSeries = Series<<IntGaugeVec as VecOf>::Builder>;
type HistogramSeries = Series<<HistogramVec as VecOf>::Builder>;

/// The builder of a metric vector type (what names [`Series`] of it).
trait VecOf {
    type Builder: MetricVecBuilder;
}

impl<B: MetricVecBuilder> VecOf for MetricVec<B> {
    type Builder = B;
}

/// The metric handles of one client-facing route, for one model label.
pub(crate) struct RouteMetrics {
    outcomes: [CounterSeries; Outcome::ALL.len()],
    /// Set once every outcome counter exists (with the first request).
    outcomes_open: OnceLock<()>,
    duration: HistogramSeries,
    ttft: HistogramSeries,
    overhead: HistogramSeries,
    in_flight: GaugeSeries,
    retries: CounterSeries,
    engine_reroutes: CounterSeries,
    prefill_stops: CounterSeries,
    prefill: HistogramSeries,
    decode_first_byte: HistogramSeries,
}

impl RouteMetrics {
    /// Counts a request as started.
    pub(crate) fn start(&self) {
        self.outcomes_open.get_or_init(|| {
            for outcome in &self.outcomes {
                outcome.get();
            }
        });
        self.in_flight.get().inc();
    }

    /// Counts a started request as no longer in flight under these labels (it moves to its
    /// model's, see [`crate::relay::Tracker::retarget`]).
    pub(crate) fn leave(&self) {
        self.in_flight.get().dec();
    }

    /// Counts a request as finished.
    pub(crate) fn finish(&self, outcome: Outcome, elapsed: Duration) {
        self.in_flight.get().dec();
        self.outcomes[outcome as usize].get().inc();
        self.duration.get().observe(elapsed.as_secs_f64());
    }

    /// Records the time from the request's arrival to D's first byte.
    pub(crate) fn first_byte(&self, elapsed: Duration) {
        self.ttft.get().observe(elapsed.as_secs_f64());
    }

    /// Records the proxy's own time on a request (see the metric's help).
    pub(crate) fn overhead(&self, elapsed: Duration) {
        self.overhead.get().observe(elapsed.as_secs_f64());
    }

    /// Counts one retry of D on another decode.
    pub(crate) fn retry(&self) {
        self.retries.get().inc();
    }

    /// Counts one call of D made again with the new engine id of a re-registered prefill.
    pub(crate) fn engine_reroute(&self) {
        self.engine_reroutes.get().inc();
    }

    /// Counts a request whose P ended before its length cap (so sent no KV) and that D then
    /// served alone.
    pub(crate) fn prefill_stopped(&self) {
        self.prefill_stops.get().inc();
    }

    /// Records how long P took to answer (its whole call).
    pub(crate) fn prefill_answered(&self, elapsed: Duration) {
        self.prefill.get().observe(elapsed.as_secs_f64());
    }

    /// Records the time from D's call being issued to its first byte.
    pub(crate) fn decode_first_byte(&self, elapsed: Duration) {
        self.decode_first_byte.get().observe(elapsed.as_secs_f64());
    }
}

/// The routing decision counters of one model label, one per possible decision.
pub(crate) struct DecisionMetrics([CounterSeries; Decision::ALL.len()]);

impl DecisionMetrics {
    /// Counts one decision.
    pub(crate) fn count(&self, decision: Decision) {
        self.0[decision.slot()].get().inc();
    }
}

/// The metric families of client requests.
pub(super) struct RouteFamilies {
    requests: IntCounterVec,
    duration: HistogramVec,
    ttft: HistogramVec,
    overhead: HistogramVec,
    in_flight: IntGaugeVec,
    retries: IntCounterVec,
    engine_reroutes: IntCounterVec,
    prefill_stops: IntCounterVec,
    prefill: HistogramVec,
    decode_first_byte: HistogramVec,
    decisions: IntCounterVec,
}

fn histogram(name: &str, help: &str, buckets: &[f64]) -> HistogramVec {
    HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        &["route", "model"],
    )
    .expect("valid metric")
}

fn counter(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
}

impl RouteFamilies {
    /// Creates the families and registers them in `registry`.
    pub(super) fn new(registry: &Registry) -> Self {
        let route = &["route", "model"];
        let families = RouteFamilies {
            requests: counter(
                "requests_total",
                "Client requests by route, model and outcome",
                &["route", "model", "outcome"],
            ),
            duration: histogram(
                "request_duration_seconds",
                "Time from a client request's arrival to the end of its answer",
                LATENCY_BUCKETS,
            ),
            ttft: histogram(
                "time_to_first_byte_seconds",
                "Time from a client request's arrival to the first byte of D's answer (TTFT when streaming)",
                LATENCY_BUCKETS,
            ),
            overhead: histogram(
                "overhead_seconds",
                "The proxy's own time per request: from the request's arrival until D's call is issued, plus from D's first byte until the answer is handed to the client",
                OVERHEAD_BUCKETS,
            ),
            in_flight: IntGaugeVec::new(
                Opts::new("requests_in_flight", "Client requests being served"),
                route,
            )
            .expect("valid metric"),
            retries: counter(
                "decode_retries_total",
                "Requests retried on another decode after D failed before its first byte",
                route,
            ),
            engine_reroutes: counter(
                "engine_reroutes_total",
                "Requests whose D was asked again with the new engine id of a prefill that \
                 re-registered (D could not find the engine it was told)",
                route,
            ),
            prefill_stops: counter(
                "prefill_stopped_total",
                "Requests whose P ended before its one-token cap (an engine that ignores \
                 min_tokens: no KV sent), their D cancelled and the request served by a decode \
                 alone",
                route,
            ),
            prefill: histogram(
                "prefill_duration_seconds",
                "Time P took to answer (its whole call: the prompt's computation and KV publication)",
                LATENCY_BUCKETS,
            ),
            decode_first_byte: histogram(
                "decode_first_byte_seconds",
                "Time from D's call being issued to its first byte (D's wait for the KV included)",
                LATENCY_BUCKETS,
            ),
            decisions: counter(
                "route_decisions_total",
                "Routing decisions: through P and D (disaggregated), to a decode alone (decode_only) or refused, and why, by model",
                &["decision", "reason", "model"],
            ),
        };
        for collector in [
            Box::new(families.requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(families.decisions.clone()),
            Box::new(families.duration.clone()),
            Box::new(families.ttft.clone()),
            Box::new(families.overhead.clone()),
            Box::new(families.in_flight.clone()),
            Box::new(families.retries.clone()),
            Box::new(families.engine_reroutes.clone()),
            Box::new(families.prefill_stops.clone()),
            Box::new(families.prefill.clone()),
            Box::new(families.decode_first_byte.clone()),
        ] {
            registry
                .register(collector)
                .expect("metric names are unique");
        }
        families
    }

    /// The handles of `route` for `model`.
    pub(super) fn route(&self, route: &str, model: &str) -> RouteMetrics {
        let labels = &[route, model];
        RouteMetrics {
            outcomes: Outcome::ALL
                .map(|o| Series::new(&self.requests, &[route, model, o.as_str()])),
            outcomes_open: OnceLock::new(),
            duration: Series::new(&self.duration, labels),
            ttft: Series::new(&self.ttft, labels),
            overhead: Series::new(&self.overhead, labels),
            in_flight: Series::new(&self.in_flight, labels),
            retries: Series::new(&self.retries, labels),
            engine_reroutes: Series::new(&self.engine_reroutes, labels),
            prefill_stops: Series::new(&self.prefill_stops, labels),
            prefill: Series::new(&self.prefill, labels),
            decode_first_byte: Series::new(&self.decode_first_byte, labels),
        }
    }

    /// The decision counters of `model`.
    pub(super) fn decisions(&self, model: &str) -> DecisionMetrics {
        DecisionMetrics(
            Decision::ALL
                .map(|d| Series::new(&self.decisions, &[d.path_label(), d.reason_label(), model])),
        )
    }
}
