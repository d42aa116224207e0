//! The routing scenarios: a workload through a cluster of simulated engines with prefix
//! caches, once per routing setup (the proxies' policies), each on a fresh cluster: prefix-cache
//! hit rate, TTFT and throughput. [`chat`] is a multi-turn chat; [`tenants`] many tenants with
//! long system prompts through two proxy replicas.
//!
//! A workload is a number of sessions, each a list of prompts sent in turn (streamed), a
//! number of sessions at once; each session goes through one of the proxies, drawn by a hash of
//! its number (so that no pattern of the workload, such as its tenants, follows a proxy).

pub mod chat;
pub mod tenants;

use std::path::Path;
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use super::chart::{grouped_bars, Series};
use crate::cluster::{Cluster, ClusterSpec};
use crate::openai_client::send;

/// A workload, the setups it is run under and the cluster it runs on.
pub struct Scenario {
    /// What it is, for titles ("a multi-turn chat workload").
    pub name: &'static str,
    /// The prefix of its charts' names.
    pub chart: &'static str,
    /// Sessions.
    pub sessions: usize,
    /// Sessions at once.
    pub concurrency: usize,
    /// The prompts of a session, in order.
    pub prompts: Box<dyn Fn(usize) -> Vec<String> + Send + Sync>,
    /// The setups compared, with the proxy flags that make each.
    pub setups: Vec<(&'static str, Vec<&'static str>)>,
    /// The cluster's shape (engines, caches, timings, proxies).
    pub shape: Box<dyn Fn(&mut ClusterSpec) + Send + Sync>,
}

/// One routing setup's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RoutingRow {
    /// The setup's name.
    pub setup: String,
    /// Requests answered.
    pub requests: usize,
    /// Prompt tokens found in the engines' prefix caches, of all prompt tokens computed.
    pub hit_rate: f64,
    /// Requests served by a decode alone.
    pub decode_only: u64,
    /// TTFT quantiles, ms.
    pub ttft_p50_ms: f64,
    /// 90th percentile.
    pub ttft_p90_ms: f64,
    /// 99th percentile.
    pub ttft_p99_ms: f64,
    /// Requests per second over the run.
    pub throughput: f64,
}

/// The scenarios' cluster: four prefills of one rank and two decodes, a prefill computing
/// `prefill_us_per_token`, 5 ms per generated token, little KV per token, prefix caches of
/// `cache_blocks`, and `engine_args` more for every engine.
pub(crate) fn four_prefills_two_decodes(
    spec: &mut ClusterSpec,
    prefill_us_per_token: u64,
    cache_blocks: usize,
    engine_args: &[&str],
) {
    spec.prefills = vec![crate::cluster::PrefillShape { dp: 1, tp: 1 }; 4];
    spec.decodes = 2;
    spec.prefill_us_per_token = prefill_us_per_token;
    spec.decode_ms_per_token = 5;
    spec.engine_args = [
        "--prefix-cache-blocks",
        &cache_blocks.to_string(),
        "--kv-bytes-per-token",
        "64",
    ]
    .into_iter()
    .chain(engine_args.iter().copied())
    .map(str::to_owned)
    .collect();
}

/// `n` bytes (tokens) of text, `tag` repeated.
pub(crate) fn tokens(tag: &str, n: usize) -> String {
    format!("{tag} ").chars().cycle().take(n).collect()
}

/// Runs `scenario` once per setup on a fresh cluster from `bin_dir`.
pub async fn compare(
    bin_dir: &Path,
    run_dir: &Path,
    scenario: &Scenario,
) -> Result<Vec<RoutingRow>, String> {
    let mut rows = Vec::new();
    for (setup, flags) in &scenario.setups {
        let dir = run_dir.join(format!("{}-{}", scenario.chart, setup.replace(' ', "_")));
        let mut spec = ClusterSpec::demo(bin_dir.to_path_buf(), dir);
        (scenario.shape)(&mut spec);
        spec.proxy_args = flags.iter().map(|f| f.to_string()).collect();
        let cluster = Cluster::start(&spec).await.map_err(|e| e.to_string())?;
        let measured = run(&cluster, scenario).await;
        let row = match measured {
            Ok((ttfts, elapsed)) => summarize(setup, &cluster, ttfts, elapsed).await,
            Err(err) => Err(err),
        };
        cluster.shutdown().await;
        rows.push(row?);
    }
    Ok(rows)
}

/// Every session, `concurrency` at a time, each prompt streamed: the TTFTs (ms) and the wall
/// time.
async fn run(cluster: &Cluster, scenario: &Scenario) -> Result<(Vec<f64>, Duration), String> {
    let http = reqwest::Client::new();
    let urls: Vec<String> = std::iter::once(&cluster.proxy)
        .chain(&cluster.replicas)
        .map(|proxy| format!("{}/v1/completions", proxy.url))
        .collect();
    let started = Instant::now();
    let sessions = stream::iter(0..scenario.sessions).map(|session| {
        let proxy = (session as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 33;
        let (http, url) = (&http, &urls[proxy as usize % urls.len()]);
        async move {
            let mut ttfts = Vec::new();
            for prompt in (scenario.prompts)(session) {
                let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 8,
                                  "stream": true, "user": format!("session-{session}")});
                let answer = send(http, url, &body, Duration::from_secs(60)).await?;
                if answer.status != 200 || answer.stream_error.is_some() {
                    return Err(format!("request failed: {} {}", answer.status, answer.text));
                }
                ttfts.push(answer.ttft.as_secs_f64() * 1e3);
            }
            Ok::<_, String>(ttfts)
        }
    });
    let mut ttfts = Vec::new();
    let mut done = sessions.buffer_unordered(scenario.concurrency.max(1));
    while let Some(session) = done.next().await {
        ttfts.extend(session?);
    }
    Ok((ttfts, started.elapsed()))
}

async fn summarize(
    setup: &str,
    cluster: &Cluster,
    mut ttfts: Vec<f64>,
    elapsed: Duration,
) -> Result<RoutingRow, String> {
    let http = reqwest::Client::new();
    let (mut queries, mut hits) = (0u64, 0u64);
    for engine in cluster.prefills.iter().chain(&cluster.decodes) {
        let stats: Value = get(&http, &format!("{}/stats", engine.url)).await?;
        queries += stats["prefix_cache_queries"].as_u64().unwrap_or(0);
        hits += stats["prefix_cache_hits"].as_u64().unwrap_or(0);
    }
    let metrics = http
        .get(format!("{}/metrics", cluster.proxy.url))
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|e| e.to_string())?
        .text()
        .await
        .map_err(|e| e.to_string())?;
    let decode_only = metrics
        .lines()
        .filter(|l| l.starts_with("pd_proxy_route_decisions_total{decision=\"decode_only\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum();
    ttfts.sort_by(f64::total_cmp);
    let at = |q: f64| ttfts[((ttfts.len() - 1) as f64 * q).round() as usize];
    let row = RoutingRow {
        setup: setup.to_owned(),
        requests: ttfts.len(),
        hit_rate: hits as f64 / queries.max(1) as f64,
        decode_only,
        ttft_p50_ms: at(0.5),
        ttft_p90_ms: at(0.9),
        ttft_p99_ms: at(0.99),
        throughput: ttfts.len() as f64 / elapsed.as_secs_f64(),
    };
    eprintln!("{}", line(&row));
    Ok(row)
}

async fn get(http: &reqwest::Client, url: &str) -> Result<Value, String> {
    http.get(url)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?
        .json()
        .await
        .map_err(|e| format!("{url}: {e}"))
}

fn line(row: &RoutingRow) -> String {
    format!(
        "| {} | {} | {:.1}% | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
        row.setup,
        row.requests,
        row.hit_rate * 100.0,
        row.decode_only,
        row.ttft_p50_ms,
        row.ttft_p90_ms,
        row.ttft_p99_ms,
        row.throughput
    )
}

/// TTFT p50, p90 and p99, and the prefix hit rate, per setup: two SVG charts, by name.
pub fn charts(scenario: &Scenario, rows: &[RoutingRow]) -> Result<Vec<(String, String)>, String> {
    let setups: Vec<String> = rows.iter().map(|r| r.setup.clone()).collect();
    let ttft = grouped_bars(
        &format!("TTFT on {}", scenario.name),
        "ms",
        &setups,
        &[
            Series::of("TTFT p50", rows, |r| r.ttft_p50_ms),
            Series::of("TTFT p90", rows, |r| r.ttft_p90_ms),
            Series::of("TTFT p99", rows, |r| r.ttft_p99_ms),
        ],
    )?;
    let hits = grouped_bars(
        &format!("Prefix-cache hit rate on {}", scenario.name),
        "% of prompt tokens",
        &setups,
        &[Series::of("hit rate", rows, |r| r.hit_rate * 100.0)],
    )?;
    Ok(vec![
        (format!("{}-ttft", scenario.chart), ttft),
        (format!("{}-hit-rate", scenario.chart), hits),
    ])
}

/// The rows as a Markdown table.
pub fn table(rows: &[RoutingRow]) -> String {
    let mut out = String::from(
        "| routing | requests | prefix hit rate | decode-only | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | req/s |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for row in rows {
        out.push_str(&line(row));
        out.push('\n');
    }
    out
}
