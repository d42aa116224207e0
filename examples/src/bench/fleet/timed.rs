//! The timed replay: a trace sent open-loop on its own timestamps (times a rate multiplier) to
//! a fleet of sim-engines running the engine model, through each system on a fresh fleet; per
//! system and rate, TTFT and TPOT quantiles, the share of requests meeting both targets, prefix
//! hit rate, the spread of prefills over engines, refusals, the load generator's own lag and the
//! sims' CPU; per system, goodput as DistServe defines it (the highest rate swept at which at
//! least 90% of requests meet both targets).
//!
//! The engines run `time_scale` times faster than the GPU modelled and the arrivals come as
//! much faster, so an hour of trace takes `1/time_scale` of an hour; every time reported is
//! the measured one times `time_scale` (the GPU's time; the proxy's and the network's part is
//! scaled too, which the report says).

use std::path::PathBuf;
use std::time::Duration;

use clap::ValueEnum;
use serde_json::Value;

use super::replay::{replay, Outcome};
use super::systems::System;
use super::trace::Trace;
use crate::bench::loadgen::ProcessUsage;
use crate::cluster::{Cluster, ClusterSpec, PrefillShape};
use crate::sim::model::Preset;

/// A timed replay's fleet, rates and targets.
#[derive(Debug, Clone)]
pub struct TimedSettings {
    /// The release binaries.
    pub bin_dir: PathBuf,
    /// Where the fleets run.
    pub run_dir: PathBuf,
    /// The peer routers' virtualenv (`examples/bench/peers.sh`), when they are measured.
    pub peers_venv: Option<PathBuf>,
    /// The engines' model.
    pub preset: Preset,
    /// How much faster than the GPU modelled the engines and arrivals run.
    pub time_scale: f64,
    /// The fleets' P:D splits (prefill engines, decode engines), every system on each.
    pub splits: Vec<(usize, usize)>,
    /// Rate multipliers swept (1: the trace's own arrivals).
    pub rates: Vec<f64>,
    /// The TTFT target.
    pub ttft_slo: Duration,
    /// The TPOT target.
    pub tpot_slo: Duration,
    /// At most this many requests of each trace.
    pub limit: Option<usize>,
    /// Only the systems whose names contain one of these (all when empty).
    pub systems: Vec<String>,
}

/// One system at one rate on one trace.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TimedRow {
    /// The trace.
    pub trace: String,
    /// The system.
    pub system: String,
    /// The fleet's P:D split.
    pub split: String,
    /// The rate multiplier.
    pub rate: f64,
    /// Requests per second offered, in the GPU's time.
    pub offered_rps: f64,
    /// Requests sent.
    pub requests: usize,
    /// Answers complete (200, every token).
    pub complete: usize,
    /// Refused (429 or 503).
    pub refused: usize,
    /// Failed otherwise (an error, a cut stream, no answer in time).
    pub failed: usize,
    /// The share of requests meeting both targets.
    pub attainment: f64,
    /// TTFT quantiles of complete answers, ms of GPU time.
    pub ttft_p50_ms: f64,
    /// 90th percentile.
    pub ttft_p90_ms: f64,
    /// 99th percentile.
    pub ttft_p99_ms: f64,
    /// TPOT quantiles, ms of GPU time.
    pub tpot_p50_ms: f64,
    /// 90th percentile.
    pub tpot_p90_ms: f64,
    /// Prompt tokens the prefills found in their prefix caches, of all they looked up.
    pub hit_rate: f64,
    /// The most requests one prefill served over the mean.
    pub spread: f64,
    /// The load generator's lag behind the schedule: 99th percentile, ms of wall time ...
    pub lag_p99_ms: f64,
    /// ... and the worst.
    pub lag_max_ms: f64,
    /// The sims' CPU per request, ms.
    pub sim_cpu_ms: f64,
    /// The sims' CPU over the run's wall time, in cores: near the machine's cores, the
    /// machine bound the run (its times are the machine's, not the model's).
    pub sim_cores: f64,
    /// The front door's (pd-proxy's or the peer's) CPU per request, ms.
    pub front_cpu_ms: f64,
}

/// A system's goodput on a trace.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GoodputRow {
    /// The trace.
    pub trace: String,
    /// The system.
    pub system: String,
    /// The fleet's P:D split.
    pub split: String,
    /// The highest rate swept meeting both targets for 90% of requests, requests per second
    /// of GPU time (0: none did).
    pub goodput_rps: f64,
    /// Its rate multiplier.
    pub rate: Option<f64>,
}

/// Every chosen system at every rate on every trace, then each one's goodput.
pub async fn rows(
    settings: &TimedSettings,
    traces: &[Trace],
) -> Result<(Vec<TimedRow>, Vec<GoodputRow>), String> {
    let systems: Vec<System> = super::systems::all(settings.peers_venv.is_some())
        .into_iter()
        .filter(|s| {
            settings.systems.is_empty() || settings.systems.iter().any(|n| s.name.contains(n))
        })
        .collect();
    if systems.is_empty() {
        return Err(format!("no system is named by {:?}", settings.systems));
    }
    let (mut rows, mut goodput) = (Vec::new(), Vec::new());
    for trace in traces {
        for &split in &settings.splits {
            for system in &systems {
                let first = rows.len();
                for &rate in &settings.rates {
                    let row = run(settings, trace, system, split, rate).await?;
                    eprintln!("{}", line(&row));
                    rows.push(row);
                }
                goodput.push(best(&rows[first..], trace, system, split));
            }
        }
    }
    Ok((rows, goodput))
}

/// The goodput of one system on one split: the highest rate of `rows` (its sweep) at which 90%
/// of requests met both targets.
fn best(rows: &[TimedRow], trace: &Trace, system: &System, split: (usize, usize)) -> GoodputRow {
    let met = rows.iter().filter(|row| row.attainment >= 0.9);
    let best = met.max_by(|a, b| a.offered_rps.total_cmp(&b.offered_rps));
    GoodputRow {
        trace: trace.name.clone(),
        system: system.name.to_owned(),
        split: format!("{}:{}", split.0, split.1),
        goodput_rps: best.map_or(0.0, |b| b.offered_rps),
        rate: best.map(|b| b.rate),
    }
}

/// One system on one split at one rate, on a fresh fleet.
async fn run(
    settings: &TimedSettings,
    trace: &Trace,
    system: &System,
    (prefills, decodes): (usize, usize),
    rate: f64,
) -> Result<TimedRow, String> {
    let label = format!(
        "{}-{}-{prefills}p{decodes}d-{rate}x",
        trace.name, system.name
    )
    .replace([' ', '/'], "_");
    let dir = settings.run_dir.join(format!("fleet-{label}"));
    let mut spec = ClusterSpec::demo(settings.bin_dir.clone(), dir.clone());
    spec.prefills = vec![PrefillShape { dp: 1, tp: 1 }; prefills];
    spec.decodes = decodes;
    spec.dialect = system.dialect;
    spec.kv_events = system.kv_events;
    let model = settings.preset.coefficients();
    let preset = settings.preset.to_possible_value().expect("named");
    spec.engine_args = [
        "--engine-model",
        preset.get_name(),
        "--time-scale",
        &settings.time_scale.to_string(),
        "--prefix-cache-blocks",
        &(model.kv_capacity_tokens / 16).to_string(),
        // The KV moves over loopback, a few bytes a token: its transfer time is not modelled.
        "--kv-bytes-per-token",
        "4",
        "--kv-wait",
        "600",
    ]
    .map(str::to_owned)
    .to_vec();
    if let super::systems::Front::PdProxy(flags) = system.front {
        spec.proxy_args = flags.iter().map(|f| f.to_string()).collect();
    }
    // A prefill queued behind long prompts is busy, not frozen: pd-proxy's per-call limits
    // (30 s to P, 60 s to D's first byte, wall time: 45 s and 90 s of GPU time at 1.5x) would
    // take it out of rotation and fail its requests, where the peers wait.
    spec.proxy_args.extend(
        [
            "--request-timeout",
            "600",
            "--prefill-timeout",
            "600",
            "--decode-first-byte-timeout",
            "600",
        ]
        .map(str::to_owned),
    );
    let cluster = Cluster::start(&spec).await.map_err(|e| e.to_string())?;
    let peer = system
        .start_peer(&cluster, &dir, settings.peers_venv.as_deref())
        .await;
    let peer = match peer {
        Ok(peer) => peer,
        Err(err) => {
            cluster.shutdown().await;
            return Err(err);
        }
    };
    let url = format!(
        "{}/v1/completions",
        peer.as_ref().unwrap_or(&cluster.proxy).url
    );
    let engines: Vec<u32> = (cluster.prefills.iter().chain(&cluster.decodes))
        .filter_map(|p| p.pid())
        .collect();
    let front: Vec<u32> = peer
        .as_ref()
        .unwrap_or(&cluster.proxy)
        .pid()
        .into_iter()
        .collect();
    let (cpu_before, front_before) = (cpu(&engines), cpu(&front));
    let before = prefill_stats(&cluster).await?;
    let speed = rate * settings.time_scale;
    let timeout = Duration::from_secs(600);
    let started = std::time::Instant::now();
    let outcomes = replay(&url, trace, speed, settings.limit, timeout).await;
    let wall = started.elapsed();
    let after = prefill_stats(&cluster).await?;
    let sim_cpu = cpu(&engines).saturating_sub(cpu_before);
    let front_cpu = cpu(&front).saturating_sub(front_before);
    if let Some(mut peer) = peer {
        peer.stop(Duration::from_secs(2)).await;
    }
    cluster.shutdown().await;
    let span = trace.requests[..outcomes.len()]
        .last()
        .map_or(Duration::ZERO, |r| r.at)
        .as_secs_f64()
        .max(1.0);
    Ok(summarize(Summary {
        settings,
        trace,
        system,
        split: format!("{prefills}:{decodes}"),
        rate,
        offered_rps: outcomes.len() as f64 * rate / span,
        outcomes: &outcomes,
        before: &before,
        after: &after,
        sim_cpu,
        front_cpu,
        wall,
    }))
}

/// What a run measured, to be summarized.
struct Summary<'a> {
    settings: &'a TimedSettings,
    trace: &'a Trace,
    system: &'a System,
    split: String,
    rate: f64,
    offered_rps: f64,
    outcomes: &'a [Outcome],
    before: &'a [(u64, u64, u64)],
    after: &'a [(u64, u64, u64)],
    sim_cpu: Duration,
    front_cpu: Duration,
    wall: Duration,
}

fn summarize(run: Summary<'_>) -> TimedRow {
    let scale = run.settings.time_scale;
    let modelled = |d: Duration| d.as_secs_f64() * 1e3 * scale;
    let complete: Vec<&Outcome> = run.outcomes.iter().filter(|o| o.complete()).collect();
    let mut ttfts: Vec<f64> = complete
        .iter()
        .filter_map(|o| o.ttft)
        .map(modelled)
        .collect();
    let mut tpots: Vec<f64> = complete
        .iter()
        .filter_map(|o| o.tpot())
        .map(modelled)
        .collect();
    let (ttft_slo, tpot_slo) = (
        run.settings.ttft_slo.as_secs_f64() * 1e3,
        run.settings.tpot_slo.as_secs_f64() * 1e3,
    );
    let met = (complete.iter())
        .filter(|o| {
            o.ttft.is_some_and(|t| modelled(t) <= ttft_slo)
                && o.tpot().is_some_and(|t| modelled(t) <= tpot_slo)
        })
        .count();
    let refused = (run.outcomes.iter())
        .filter(|o| matches!(o.status, 429 | 503))
        .count();
    let mut lags: Vec<f64> = (run.outcomes.iter())
        .map(|o| o.lag.as_secs_f64() * 1e3)
        .collect();
    let delta = |i: usize, f: fn(&(u64, u64, u64)) -> u64| {
        f(&run.after[i]).saturating_sub(f(&run.before[i]))
    };
    let (mut queries, mut hits, mut served) = (0, 0, Vec::new());
    for i in 0..run.after.len() {
        queries += delta(i, |s| s.0);
        hits += delta(i, |s| s.1);
        served.push(delta(i, |s| s.2) as f64);
    }
    let mean = served.iter().sum::<f64>() / served.len().max(1) as f64;
    let most = served.iter().copied().fold(0.0, f64::max);
    let requests = run.outcomes.len();
    TimedRow {
        trace: run.trace.name.clone(),
        system: run.system.name.to_owned(),
        split: run.split,
        rate: run.rate,
        offered_rps: run.offered_rps,
        requests,
        complete: complete.len(),
        refused,
        failed: requests - complete.len() - refused,
        attainment: met as f64 / requests.max(1) as f64,
        ttft_p50_ms: quantile(&mut ttfts, 0.5),
        ttft_p90_ms: quantile(&mut ttfts, 0.9),
        ttft_p99_ms: quantile(&mut ttfts, 0.99),
        tpot_p50_ms: quantile(&mut tpots, 0.5),
        tpot_p90_ms: quantile(&mut tpots, 0.9),
        hit_rate: hits as f64 / queries.max(1) as f64,
        spread: if mean > 0.0 { most / mean } else { 0.0 },
        lag_p99_ms: quantile(&mut lags, 0.99),
        lag_max_ms: lags.iter().copied().fold(0.0, f64::max),
        sim_cpu_ms: run.sim_cpu.as_secs_f64() * 1e3 / requests.max(1) as f64,
        sim_cores: run.sim_cpu.as_secs_f64() / run.wall.as_secs_f64().max(1e-3),
        front_cpu_ms: run.front_cpu.as_secs_f64() * 1e3 / requests.max(1) as f64,
    }
}

/// The `q` quantile (nearest rank) of `values`, 0 when empty.
fn quantile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * q).round() as usize]
}

/// The engines' CPU time together.
fn cpu(pids: &[u32]) -> Duration {
    (pids.iter())
        .filter_map(|&pid| ProcessUsage::read(pid))
        .map(|usage| usage.cpu)
        .sum()
}

/// Each prefill's prefix-cache queried and hit tokens and requests, from `/stats`.
async fn prefill_stats(cluster: &Cluster) -> Result<Vec<(u64, u64, u64)>, String> {
    let http = reqwest::Client::new();
    let mut stats = Vec::new();
    for prefill in &cluster.prefills {
        let url = format!("{}/stats", prefill.url);
        let value: Value = http
            .get(&url)
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("{url}: {e}"))?
            .json()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let field = |name: &str| value[name].as_u64().unwrap_or(0);
        stats.push((
            field("prefix_cache_queries"),
            field("prefix_cache_hits"),
            field("requests"),
        ));
    }
    Ok(stats)
}

/// A row as a line of [`table`].
pub fn line(row: &TimedRow) -> String {
    format!(
        "| {} | {} | {} | {} | {:.2} | {} | {} | {} | {} | {:.1}% | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1}% | {:.2} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} |",
        row.trace,
        row.system,
        row.split,
        row.rate,
        row.offered_rps,
        row.requests,
        row.complete,
        row.refused,
        row.failed,
        row.attainment * 100.0,
        row.ttft_p50_ms,
        row.ttft_p90_ms,
        row.ttft_p99_ms,
        row.tpot_p50_ms,
        row.tpot_p90_ms,
        row.hit_rate * 100.0,
        row.spread,
        row.lag_p99_ms,
        row.lag_max_ms,
        row.sim_cpu_ms,
        row.sim_cores,
        row.front_cpu_ms,
    )
}

/// The rows as a Markdown table.
pub fn table(rows: &[TimedRow]) -> String {
    let mut out = String::from(
        "| trace | system | P:D | rate | offered req/s | requests | complete | refused | failed | \
         within targets | TTFT p50 ms | p90 | p99 | TPOT p50 ms | p90 | prefix hit rate | \
         prefill spread | lag p99 ms | lag max ms | sim CPU ms/req | sims' cores | front CPU \
         ms/req |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for row in rows {
        out.push_str(&line(row));
        out.push('\n');
    }
    out
}

/// Goodput per system and trace as a Markdown table.
pub fn goodput_table(rows: &[GoodputRow]) -> String {
    let mut out =
        String::from("| trace | system | P:D | goodput req/s | at rate |\n|---|---|---|---|---|\n");
    for row in rows {
        let rate = row.rate.map_or("none".to_owned(), |r| format!("{r}x"));
        out.push_str(&format!(
            "| {} | {} | {} | {:.2} | {rate} |\n",
            row.trace, row.system, row.split, row.goodput_rps
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_take_the_nearest_rank() {
        let mut values = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(quantile(&mut values, 0.5), 3.0);
        assert_eq!(quantile(&mut values, 0.99), 5.0);
        assert_eq!(quantile(&mut [], 0.9), 0.0);
    }
}
