//! The metrics of the KV-event index (`--kv-events`).

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// The handles of the KV-event metrics.
#[derive(Clone)]
pub struct KvMetrics {
    /// Events applied.
    pub events: IntCounter,
    /// Payloads that could not be decoded.
    pub malformed: IntCounter,
    /// Times an engine's entries were dropped (a gap, a restart, a failed health check).
    pub rebuilds: IntCounter,
    /// (engine, block) entries in the index.
    pub blocks: IntGauge,
    /// Engines followed.
    pub engines: IntGauge,
    /// `precise_prefix` picks by choice (prefill, decode) and reason.
    pub picks: IntCounterVec,
}

impl KvMetrics {
    /// Registers them in `registry`.
    pub fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str| {
            let counter = IntCounter::with_opts(Opts::new(name, help)).expect("valid metric");
            registry
                .register(Box::new(counter.clone()))
                .expect("metric names are unique");
            counter
        };
        let gauge = |name: &str, help: &str| {
            let gauge = IntGauge::with_opts(Opts::new(name, help)).expect("valid metric");
            registry
                .register(Box::new(gauge.clone()))
                .expect("metric names are unique");
            gauge
        };
        let picks = IntCounterVec::new(
            Opts::new(
                "route_picks_total",
                "precise_prefix picks by choice (prefill, decode) and reason (kv_hit: the chosen \
                 engine holds part of the prompt; kv_miss: none does; no_tokens: the prompt's \
                 tokens are unknown; no_events: no candidate's events are followed)",
            ),
            &["choice", "reason"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(picks.clone()))
            .expect("metric names are unique");
        KvMetrics {
            picks,
            events: counter("kv_events_total", "KV cache events applied to the index"),
            malformed: counter(
                "kv_events_malformed_total",
                "KV event payloads that could not be decoded",
            ),
            rebuilds: counter(
                "kv_index_rebuilds_total",
                "Times an engine's index entries were dropped to be rebuilt (a sequence gap \
                 replay could not fill, a restart, a failed health check)",
            ),
            blocks: gauge("kv_index_blocks", "(engine, block) entries in the KV index"),
            engines: gauge("kv_index_engines", "Engines whose KV events are followed"),
        }
    }
}
