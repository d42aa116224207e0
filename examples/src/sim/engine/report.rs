//! What the engine reports about itself: `GET /stats` (its counters as JSON) and `GET
//! /metrics` (vLLM's names, or SGLang's for its dialect, in Prometheus' text format).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use pd_transfer::KvExporter;
use serde_json::{json, Value};

use super::Engine;
use crate::sim::config::Dialect;

/// The engine's metrics in Prometheus' text format: its requests running and
/// waiting and its KV cache's usage under vLLM's names (SGLang's for its dialect: what a router
/// reads for load and saturation), the prefix caches' queried and hit tokens; and the
/// simulator's own: KV event batches published and dropped.
pub(super) async fn metrics(State(engine): State<Arc<Engine>>) -> String {
    let registry = prometheus::Registry::new();
    let labels = [("model_name".to_owned(), engine.args.model.clone())];
    let gauge = |name: &str, help: &str, value: u64| {
        let opts = prometheus::Opts::new(name, help).const_labels(labels.iter().cloned().collect());
        let gauge = prometheus::IntGauge::with_opts(opts).expect("a valid metric");
        gauge.set(i64::try_from(value).unwrap_or(i64::MAX));
        registry.register(Box::new(gauge)).expect("unique names");
    };
    let float_gauge = |name: &str, help: &str, value: f64| {
        let opts = prometheus::Opts::new(name, help).const_labels(labels.iter().cloned().collect());
        let gauge = prometheus::Gauge::with_opts(opts).expect("a valid metric");
        gauge.set(value);
        registry.register(Box::new(gauge)).expect("unique names");
    };
    let counter = |name: &str, help: &str, value: u64| {
        let opts = prometheus::Opts::new(name, help).const_labels(labels.iter().cloned().collect());
        let counter = prometheus::IntCounter::with_opts(opts).expect("a valid metric");
        counter.inc_by(value);
        registry.register(Box::new(counter)).expect("unique names");
    };
    let (queries, hits) = engine.prefix_cache_counts();
    let (published, dropped) = engine.kv_event_counts();
    let load = engine.load();
    let (running, waiting) = (load.running as u64, load.waiting as u64);
    match engine.args.dialect {
        Dialect::Vllm => {
            gauge(
                "vllm:num_requests_running",
                "Requests in the running batch",
                running,
            );
            gauge(
                "vllm:num_requests_waiting",
                "Requests waiting to enter it",
                waiting,
            );
            float_gauge(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                load.kv_usage,
            );
            counter(
                "vllm:num_preemptions_total",
                "Requests preempted (their KV freed, recomputed later)",
                load.preemptions,
            );
        }
        Dialect::Sglang => {
            gauge(
                "sglang:num_running_reqs",
                "Requests in the running batch",
                running,
            );
            gauge(
                "sglang:num_queue_reqs",
                "Requests waiting to enter it",
                waiting,
            );
            float_gauge(
                "sglang:token_usage",
                "The share of the KV cache's tokens in use",
                load.kv_usage,
            );
        }
    }
    counter(
        "vllm:prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache",
        queries,
    );
    counter(
        "vllm:prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache",
        hits,
    );
    counter(
        "sim:kv_event_batches_published_total",
        "KV cache event batches sent on the publishers' PUB sockets",
        published,
    );
    counter(
        "sim:kv_event_batches_dropped_total",
        "KV cache event batches dropped at a full publisher queue",
        dropped,
    );
    let mut out = String::new();
    prometheus::TextEncoder::new()
        .encode_utf8(&registry.gather(), &mut out)
        .expect("the text format encodes");
    out
}

/// `GET /stats`: the engine's model and LoRA adapters, its counters, its workers and meta (a
/// prefill's), as JSON.
pub(super) async fn stats(State(engine): State<Arc<Engine>>) -> Json<Value> {
    let s = &engine.stats;
    let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let (queries, hits) = engine.prefix_cache_counts();
    let (published, dropped) = engine.kv_event_counts();
    Json(json!({
        "role": format!("{:?}", engine.args.role).to_lowercase(),
        "model": engine.args.model,
        "lora_adapters": engine.adapters.list().iter().map(|a| &a.name).collect::<Vec<_>>(),
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
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "kv_events_published": published,
        "kv_events_dropped": dropped,
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

impl Engine {
    /// Prompt tokens queried and hit, over every dp rank's prefix cache.
    fn prefix_cache_counts(&self) -> (u64, u64) {
        self.prefix_caches.iter().fold((0, 0), |(q, h), c| {
            let load = |n: &AtomicU64| n.load(Ordering::Relaxed);
            (q + load(&c.queries), h + load(&c.hits))
        })
    }

    /// KV event batches published and dropped, over every dp rank's publisher.
    fn kv_event_counts(&self) -> (u64, u64) {
        let publishers = self.publishers.iter();
        publishers.fold((0, 0), |(p, d), x| (p + x.published(), d + x.dropped()))
    }
}
