//! The routing scenario: a multi-turn chat workload through a cluster of simulated engines with
//! prefix caches, once per routing setup (round robin, least loaded, consistent hash on the
//! session, cache aware, cache aware with conditional disaggregation), each on a fresh cluster:
//! prefix-cache hit rate, TTFT and throughput.
//!
//! Sessions share a few system prompts; each turn's prompt is the whole conversation so far (the
//! system prompt, every earlier question and answer) and a new question, as chat clients send it.
//! An engine that served the previous turn holds all but the newest part in its prefix cache.

use std::path::Path;
use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use super::chart::{grouped_bars, Series};
use crate::cluster::{Cluster, ClusterSpec, PrefillShape};
use crate::openai_client::send;

/// The chat workload.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// Conversations.
    pub sessions: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Conversations running at once.
    pub concurrency: usize,
    /// Distinct system prompts the conversations share.
    pub system_prompts: usize,
}

impl Workload {
    /// The default: 200 five-turn conversations, 16 at a time, over 8 system prompts.
    pub const CHAT: Workload = Workload {
        sessions: 200,
        turns: 5,
        concurrency: 16,
        system_prompts: 8,
    };
}

/// Tokens of a system prompt, a question and an answer (the engines' default tokenizer makes
/// one token of each byte).
const SYSTEM_TOKENS: usize = 50;
const QUESTION_TOKENS: usize = 200;
const ANSWER_TOKENS: usize = 50;

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
    /// 99th percentile.
    pub ttft_p99_ms: f64,
    /// Requests per second over the run.
    pub throughput: f64,
}

/// The setups compared, with the proxy flags that make each.
pub fn setups() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![
        ("round_robin", vec!["--policy", "round_robin"]),
        ("least_loaded", vec!["--policy", "least_loaded"]),
        ("consistent_hash", vec!["--policy", "consistent_hash"]),
        ("cache_aware", vec!["--policy", "cache_aware"]),
        (
            "cache_aware + decode-only on prefix hit",
            vec![
                "--policy",
                "cache_aware",
                "--decode-only-prefix-share",
                "0.5",
            ],
        ),
    ]
}

/// `n` bytes (tokens) of text, `tag` repeated.
fn tokens(tag: &str, n: usize) -> String {
    format!("{tag} ").chars().cycle().take(n).collect()
}

/// The prompts of one conversation, turn by turn.
fn conversation(session: usize, workload: &Workload) -> Vec<String> {
    let mut history = tokens(
        &format!("sys{}", session % workload.system_prompts),
        SYSTEM_TOKENS,
    );
    (0..workload.turns)
        .map(|turn| {
            history.push_str(&tokens(&format!("s{session}q{turn}"), QUESTION_TOKENS));
            let prompt = history.clone();
            history.push_str(&tokens(&format!("s{session}a{turn}"), ANSWER_TOKENS));
            prompt
        })
        .collect()
}

/// Runs `workload` once per setup on a fresh cluster from `bin_dir`.
pub async fn compare(
    bin_dir: &Path,
    run_dir: &Path,
    workload: Workload,
) -> Result<Vec<RoutingRow>, String> {
    let mut rows = Vec::new();
    for (setup, flags) in setups() {
        let mut spec =
            ClusterSpec::demo(bin_dir.to_path_buf(), run_dir.join(setup.replace(' ', "_")));
        spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; 4];
        spec.decodes = 2;
        spec.prefill_us_per_token = 200;
        spec.decode_ms_per_token = 5;
        spec.proxy_args = flags.iter().map(|f| f.to_string()).collect();
        spec.engine_args = [
            "--prefix-cache-blocks",
            "2048",
            "--kv-bytes-per-token",
            "64",
        ]
        .map(str::to_owned)
        .to_vec();
        let cluster = Cluster::start(&spec).await.map_err(|e| e.to_string())?;
        let measured = run(&cluster, &workload).await;
        let row = match measured {
            Ok((ttfts, elapsed)) => summarize(setup, &cluster, ttfts, elapsed).await,
            Err(err) => Err(err),
        };
        cluster.shutdown().await;
        rows.push(row?);
    }
    Ok(rows)
}

/// Every conversation, `concurrency` at a time, each turn streamed: the TTFTs (ms) and the
/// wall time.
async fn run(cluster: &Cluster, workload: &Workload) -> Result<(Vec<f64>, Duration), String> {
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", cluster.proxy.url);
    let started = Instant::now();
    let sessions = stream::iter(0..workload.sessions).map(|session| {
        let (http, url) = (&http, &url);
        async move {
            let mut ttfts = Vec::new();
            for prompt in conversation(session, workload) {
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
    let mut done = sessions.buffer_unordered(workload.concurrency.max(1));
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
        "| {} | {} | {:.1}% | {} | {:.1} | {:.1} | {:.1} |",
        row.setup,
        row.requests,
        row.hit_rate * 100.0,
        row.decode_only,
        row.ttft_p50_ms,
        row.ttft_p99_ms,
        row.throughput
    )
}

/// TTFT p50 and p99, and the prefix hit rate, per setup: two SVG charts, by name.
pub fn charts(rows: &[RoutingRow]) -> Result<Vec<(&'static str, String)>, String> {
    let setups: Vec<String> = rows.iter().map(|r| r.setup.clone()).collect();
    let ttft = grouped_bars(
        "TTFT on a multi-turn chat workload",
        "ms",
        &setups,
        &[
            Series::of("TTFT p50", rows, |r| r.ttft_p50_ms),
            Series::of("TTFT p99", rows, |r| r.ttft_p99_ms),
        ],
    )?;
    let hits = grouped_bars(
        "Prefix-cache hit rate on a multi-turn chat workload",
        "% of prompt tokens",
        &setups,
        &[Series::of("hit rate", rows, |r| r.hit_rate * 100.0)],
    )?;
    Ok(vec![("routing-ttft", ttft), ("routing-hit-rate", hits)])
}

/// The rows as a Markdown table.
pub fn table(rows: &[RoutingRow]) -> String {
    let mut out = String::from(
        "| routing | requests | prefix hit rate | decode-only | TTFT p50 ms | TTFT p99 ms | req/s |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for row in rows {
        out.push_str(&line(row));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_turn_carries_the_whole_conversation() {
        let workload = Workload {
            sessions: 4,
            turns: 3,
            concurrency: 1,
            system_prompts: 2,
        };
        let turns = conversation(1, &workload);
        assert_eq!(turns.len(), 3);
        assert!(turns[2].starts_with(&turns[1]) && turns[1].starts_with(&turns[0]));
        assert_eq!(turns[0].len(), SYSTEM_TOKENS + QUESTION_TOKENS);
        assert_eq!(
            turns[1].len(),
            turns[0].len() + ANSWER_TOKENS + QUESTION_TOKENS
        );
        // Sessions 1 and 3 share a system prompt, 0 and 1 do not.
        let system = |s: usize| conversation(s, &workload)[0][..SYSTEM_TOKENS].to_owned();
        assert_eq!(system(1), system(3));
        assert_ne!(system(0), system(1));
    }
}
