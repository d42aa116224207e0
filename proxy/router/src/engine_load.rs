//! The load engines report: each backend's `/metrics` scraped every `--engine-metrics-interval`
//! for requests running and waiting (and the signals of its saturation: waiting requests, KV
//! cache usage; [`crate::saturation`]) (vLLM's `vllm:num_requests_running` and
//! `vllm:num_requests_waiting`, SGLang's `sglang:num_running_reqs` and `sglang:num_queue_reqs`,
//! summed over the engine's label sets, e.g. its dp ranks). The policies then see the larger of
//! that and the requests in flight through this proxy, so traffic from other proxies and
//! clients counts too. An engine without `/metrics` (404) is asked again only every 30
//! intervals; one that fails is asked again at the next tick, its last answer forgotten.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::saturation::{EngineSignals, SaturationConfig};

/// The metric names whose values sum to an engine's queue: running and waiting requests.
const QUEUE_METRICS: [&str; 4] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
];

/// The metric names of requests running in an engine's batch.
const RUNNING_METRICS: [&str; 2] = ["vllm:num_requests_running", "sglang:num_running_reqs"];

/// The metric names of requests waiting in an engine's scheduler.
const WAITING_METRICS: [&str; 2] = ["vllm:num_requests_waiting", "sglang:num_queue_reqs"];

/// The metric names of the share of an engine's KV cache in use (0 to 1): vLLM's, its name
/// before 0.10, SGLang's.
const KV_USAGE_METRICS: [&str; 3] = [
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];

/// Running plus waiting requests in a `/metrics` answer, if it names any.
pub fn queue_length(text: &str) -> Option<usize> {
    let (total, _) = samples(text, &QUEUE_METRICS)?;
    Some(total.round() as usize)
}

/// What a `/metrics` answer says of the engine's scheduler and cache: the requests waiting
/// (summed over its label sets, e.g. dp ranks) and the KV cache's share in use (their mean).
pub fn signals(text: &str) -> EngineSignals {
    EngineSignals {
        waiting: samples(text, &WAITING_METRICS).map(|(total, _)| total.round() as usize),
        running: samples(text, &RUNNING_METRICS).map(|(total, _)| total.round() as usize),
        kv_usage: samples(text, &KV_USAGE_METRICS).map(|(total, count)| total / count as f64),
    }
}

/// The sum and the count of the samples of metrics named `names`, if there are any.
///
/// Reads the sample lines of Prometheus' text format (`name{labels} value [timestamp]`)
/// itself: the crate that parses the format (prometheus-parse) rejects the colons in vLLM's and
/// SGLang's metric names.
fn samples(text: &str, names: &[&str]) -> Option<(f64, usize)> {
    let mut total: Option<(f64, usize)> = None;
    for line in text.lines() {
        let line = line.trim_start();
        let Some(name) = names.iter().find(|name| line.starts_with(**name)) else {
            continue;
        };
        let rest = &line[name.len()..];
        let rest = match rest.strip_prefix('{') {
            // Label values may hold `}` only inside quotes; vLLM's and SGLang's never do.
            Some(labelled) => match labelled.split_once('}') {
                Some((_, after)) => after,
                None => continue,
            },
            None if rest.starts_with([' ', '\t']) => rest,
            None => continue, // another metric whose name starts the same
        };
        let value = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok());
        if let Some(value) = value.filter(|v| v.is_finite() && *v >= 0.0) {
            let (sum, count) = total.get_or_insert((0.0, 0));
            *sum += value;
            *count += 1;
        }
    }
    total
}

/// How many intervals pass before a backend that answered 404 is asked again.
const NO_METRICS_BACKOFF: u32 = 30;

/// Scrapes `backend`'s `/metrics` every `interval` (each call bounded by `timeout`), and
/// judges whether it is saturated under `saturation` after each; a backend that has none (404)
/// is asked again only every 30 intervals.
pub async fn scrape_forever(
    backend: Arc<Backend>,
    client: reqwest::Client,
    interval: Duration,
    timeout: Duration,
    saturation: SaturationConfig,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut without_metrics = false;
    loop {
        ticker.tick().await;
        let answer = client
            .get(backend.metrics_url.clone())
            .timeout(timeout)
            .send()
            .await;
        if answer.is_ok() {
            // An engine that answers is alive, however slow its /health (see `health`).
            backend.progressed();
        }
        without_metrics &= matches!(&answer, Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND);
        let text = match answer {
            Ok(response) if response.status() == reqwest::StatusCode::NOT_FOUND => {
                if !without_metrics {
                    tracing::info!(
                        backend = backend.url(),
                        "the backend has no /metrics: its load is this proxy's requests in flight"
                    );
                }
                without_metrics = true;
                backend.set_engine_load(None);
                backend.judge_saturation(&saturation, Instant::now());
                tokio::time::sleep(interval * NO_METRICS_BACKOFF).await;
                continue;
            }
            Ok(response) if response.status().is_success() => read_capped(response).await,
            _ => None,
        };
        if let Some(text) = &text {
            backend.record_signals(signals(text), Instant::now());
        }
        backend.set_engine_load(text.as_deref().and_then(queue_length));
        backend.judge_saturation(&saturation, Instant::now());
    }
}

/// The most of a `/metrics` answer read (vLLM's is tens of KiB); beyond it the answer is
/// ignored, so a broken backend cannot fill the proxy's memory.
const MAX_METRICS_BYTES: usize = 4 << 20;

/// The answer's text, unless it is longer than [`MAX_METRICS_BYTES`] or breaks off.
async fn read_capped(mut response: reqwest::Response) -> Option<String> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.ok()? {
        if body.len() + chunk.len() > MAX_METRICS_BYTES {
            return None;
        }
        body.extend_from_slice(&chunk);
    }
    String::from_utf8(body).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_and_waiting_are_summed_over_label_sets() {
        let vllm =
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
            # TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 4.0\n\
            # TYPE vllm:num_requests_waiting gauge\n\
            vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 5.0\n\
            # TYPE vllm:prefix_cache_hits counter\n\
            vllm:prefix_cache_hits_total{engine=\"0\"} 999.0\n";
        assert_eq!(queue_length(vllm), Some(12));
        let sglang =
            "sglang:num_running_reqs{tp_rank=\"0\"} 2\nsglang:num_queue_reqs{tp_rank=\"0\"} 1\n";
        assert_eq!(queue_length(sglang), Some(3));
        assert_eq!(queue_length("other_metric 5\n"), None);
        assert_eq!(queue_length("vllm:num_requests_running NaN\n"), None);
        assert_eq!(queue_length("vllm:num_requests_running_total 7\n"), None);
        assert_eq!(
            queue_length("vllm:num_requests_waiting 7 1700000000\n"),
            Some(7)
        );
    }

    #[test]
    fn waiting_is_summed_and_kv_usage_averaged_over_label_sets() {
        let vllm = "vllm:num_requests_waiting{engine=\"0\"} 3.0\n\
            vllm:num_requests_waiting{engine=\"1\"} 4.0\n\
            vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
            vllm:kv_cache_usage_perc{engine=\"1\"} 1.0\n";
        assert_eq!(
            signals(vllm),
            EngineSignals {
                waiting: Some(7),
                running: None,
                kv_usage: Some(0.75)
            }
        );
        let sglang =
            "sglang:num_queue_reqs{tp_rank=\"0\"} 2\nsglang:token_usage{tp_rank=\"0\"} 0.25\n";
        assert_eq!(signals(sglang).waiting, Some(2));
        assert_eq!(signals(sglang).kv_usage, Some(0.25));
        assert_eq!(signals("other 1\n"), EngineSignals::default());
    }
}
