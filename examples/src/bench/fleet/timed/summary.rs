//! What a timed run measured, summed up into its row: latency quantiles of the complete
//! answers in the GPU's time, the share within both targets, refusals and failures, the
//! prefills' hit rate and spread from their `/stats`, the load generator's lag and CPU.

use std::time::Duration;

use serde_json::Value;

use super::{TimedRow, TimedSettings};
use crate::bench::fleet::replay::Outcome;
use crate::bench::fleet::systems::System;
use crate::bench::fleet::trace::Trace;
use crate::bench::loadgen::ProcessUsage;
use crate::cluster::Cluster;

/// What a run measured, to be summarized.
pub(super) struct Summary<'a> {
    pub(super) settings: &'a TimedSettings,
    pub(super) trace: &'a Trace,
    pub(super) system: &'a System,
    pub(super) split: String,
    pub(super) rate: f64,
    pub(super) offered_rps: f64,
    pub(super) outcomes: &'a [Outcome],
    pub(super) before: &'a [(u64, u64, u64)],
    pub(super) after: &'a [(u64, u64, u64)],
    pub(super) sim_cpu: Duration,
    pub(super) front_cpu: Duration,
    pub(super) wall: Duration,
    /// Engine-seconds of the GPU's time spent by engines in service.
    pub(super) engine_seconds: f64,
    /// Duty changes of engines of both roles.
    pub(super) role_changes: u64,
    /// Engines the autoscaler stopped.
    pub(super) stops: usize,
}

/// The run's row.
pub(super) fn summarize(run: Summary<'_>) -> TimedRow {
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
        roles: run.system.roles,
        peer: run.system.is_peer(),
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
        engine_seconds: run.engine_seconds,
        role_changes: run.role_changes,
        stops: run.stops,
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
pub(super) fn cpu(pids: &[u32]) -> Duration {
    (pids.iter())
        .filter_map(|&pid| ProcessUsage::read(pid))
        .map(|usage| usage.cpu)
        .sum()
}

/// Each prefill's prefix-cache queried and hit tokens and requests, from `/stats`.
pub(super) async fn prefill_stats(cluster: &Cluster) -> Result<Vec<(u64, u64, u64)>, String> {
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
