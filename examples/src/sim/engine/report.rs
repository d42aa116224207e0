//! What the engine reports about itself: `GET /stats` (its counters as JSON) and `GET
//! /metrics` (vLLM's names, in Prometheus' text format).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use pd_transfer::KvExporter;
use serde_json::{json, Value};

use super::Engine;

/// vLLM's metrics this engine can report, in Prometheus' text format: requests running and
/// waiting (the load a router may read) and the prefix cache's queried and hit tokens.
pub(super) async fn metrics(State(engine): State<Arc<Engine>>) -> String {
    let registry = prometheus::Registry::new();
    let labels = [("model_name".to_owned(), engine.args.model.clone())];
    let gauge = |name: &str, help: &str, value: u64| {
        let opts = prometheus::Opts::new(name, help).const_labels(labels.iter().cloned().collect());
        let gauge = prometheus::IntGauge::with_opts(opts).expect("a valid metric");
        gauge.set(i64::try_from(value).unwrap_or(i64::MAX));
        registry.register(Box::new(gauge)).expect("unique names");
    };
    let counter = |name: &str, help: &str, value: u64| {
        let opts = prometheus::Opts::new(name, help).const_labels(labels.iter().cloned().collect());
        let counter = prometheus::IntCounter::with_opts(opts).expect("a valid metric");
        counter.inc_by(value);
        registry.register(Box::new(counter)).expect("unique names");
    };
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let cache = engine.prefix_cache.as_ref();
    gauge(
        "vllm:num_requests_running",
        "Requests being handled",
        load(&engine.stats.running),
    );
    gauge(
        "vllm:num_requests_waiting",
        "Requests queued (the simulator queues none)",
        0,
    );
    counter(
        "vllm:prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache",
        cache.map_or(0, |c| load(&c.queries)),
    );
    counter(
        "vllm:prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache",
        cache.map_or(0, |c| load(&c.hits)),
    );
    let mut out = String::new();
    prometheus::TextEncoder::new()
        .encode_utf8(&registry.gather(), &mut out)
        .expect("the text format encodes");
    out
}

/// `GET /stats`: the engine's counters, its workers and meta (a prefill's), as JSON.
pub(super) async fn stats(State(engine): State<Arc<Engine>>) -> Json<Value> {
    let s = &engine.stats;
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    Json(json!({
        "role": format!("{:?}", engine.args.role).to_lowercase(),
        "transfer": engine.args.transfer.scheme(),
        "engine_ids": engine.engine_ids,
        "requests": load(&s.requests),
        "kv_published": load(&s.kv_published),
        "kv_transfers_verified": load(&s.kv_transfers_verified),
        "kv_transfers_failed": load(&s.kv_transfers_failed),
        "kv_bytes_pulled": load(&s.kv_bytes_pulled),
        "kv_pending": engine.exporters.values().map(KvExporter::pending).sum::<usize>(),
        "leases_alive": engine.leases_mut().iter().filter(|k| k.is_alive()).count(),
        "running": load(&s.running),
        "prefix_cache_queries": engine.prefix_cache.as_ref().map_or(0, |c| load(&c.queries)),
        "prefix_cache_hits": engine.prefix_cache.as_ref().map_or(0, |c| load(&c.hits)),
        "workers": engine.exporters.iter().map(|(shard, exporter)| json!({
            "engine_id": engine.engine_ids[shard.dp as usize],
            "dp_rank": shard.dp,
            "tp_rank": shard.tp,
            "pp_rank": shard.pp,
            "addr": exporter.transfer_addr(),
        })).collect::<Vec<_>>(),
        "meta": engine.args.engine_meta(),
    }))
}
