//! The timed replay: a trace sent open-loop on its own timestamps (times a rate multiplier) to
//! a fleet of sim-engines running the engine model, through each system on a fresh fleet
//! ([`run`]); per system and rate, TTFT and TPOT quantiles, the share of requests meeting both
//! targets, prefix hit rate, the spread of prefills over engines, refusals, the load
//! generator's own lag, the sims' CPU and the engine-seconds spent ([`summary`]); per system,
//! goodput as DistServe defines it (the highest rate swept at which at least 90% of requests
//! meet both targets). pd-proxy's fixed splits run first, so that the split the peers and the
//! autoscaler get is the best one, chosen after the fact.
//!
//! The engines run `time_scale` times faster than the GPU modelled and the arrivals come as
//! much faster, so an hour of trace takes `1/time_scale` of an hour; every time reported is
//! the measured one times `time_scale` (the GPU's time; the proxy's and the network's part is
//! scaled too, which the report says).

mod run;
mod summary;
mod tables;

use std::path::PathBuf;
use std::time::Duration;

pub use tables::{goodput_table, line, table};

use super::systems::{Roles, System};
use super::trace::Trace;
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
    /// The fleets' P:D splits (prefill engines, decode engines): pd-proxy's fixed-role
    /// systems on each, the peers on the best (or each, when no pd-proxy system ran), the
    /// moving roles on a fleet of each size, the autoscaled system on the best.
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
    /// An engine's start-up, in the GPU's time, as the autoscaled runs model it.
    pub start_delay: Duration,
    /// The autoscaled runs' planner's safe time before one engine fewer, in the GPU's time.
    pub scale_down_after: Duration,
}

/// One system at one rate on one trace.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TimedRow {
    /// The trace.
    pub trace: String,
    /// The system.
    pub system: String,
    /// The fleet's P:D split (`N both` for engines of both roles).
    pub split: String,
    /// How its engines serve the roles.
    pub roles: Roles,
    /// Whether the system is a peer router.
    pub peer: bool,
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
    /// Engine-seconds in the GPU's time: every engine from the first request sent to the last
    /// answer, but those the autoscaler had stopped.
    pub engine_seconds: f64,
    /// Engines of both roles that changed duty.
    pub role_changes: u64,
    /// Engines the autoscaler stopped.
    pub stops: usize,
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
    /// How its engines serve the roles.
    pub roles: Roles,
    /// Whether the system is a peer router.
    pub peer: bool,
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
    let of = |roles: Roles, peer: bool| -> Vec<&System> {
        (systems.iter())
            .filter(|s| s.roles == roles && s.is_peer() == peer)
            .collect()
    };
    let mut sweeps = Sweeps::default();
    for trace in traces {
        for &split in &settings.splits {
            for system in of(Roles::Fixed, false) {
                sweeps.sweep(settings, trace, system, split).await?;
            }
        }
        let best = sweeps.best_split(trace);
        let peer_splits = best.map_or_else(|| settings.splits.clone(), |best| vec![best]);
        for system in of(Roles::Fixed, true) {
            for &split in &peer_splits {
                sweeps.sweep(settings, trace, system, split).await?;
            }
        }
        let mut sizes: Vec<usize> = Vec::new();
        for size in settings.splits.iter().map(|(p, d)| p + d) {
            if !sizes.contains(&size) {
                sizes.push(size);
            }
        }
        for system in of(Roles::Moving, false) {
            for &size in &sizes {
                // Half on each duty at the start, as pd-proxy's --dual does by default.
                let split = (size.div_ceil(2), size / 2);
                sweeps.sweep(settings, trace, system, split).await?;
            }
        }
        let peak = best.unwrap_or(settings.splits[0]);
        for system in of(Roles::Autoscaled, false) {
            sweeps.sweep(settings, trace, system, peak).await?;
        }
    }
    Ok((sweeps.rows, sweeps.goodput))
}

/// The runs so far.
#[derive(Default)]
struct Sweeps {
    rows: Vec<TimedRow>,
    goodput: Vec<GoodputRow>,
    /// pd-proxy's fixed-role goodput per trace and split.
    fixed: Vec<(String, (usize, usize), f64)>,
}

impl Sweeps {
    /// `system` on `split` at every rate, then its goodput.
    async fn sweep(
        &mut self,
        settings: &TimedSettings,
        trace: &Trace,
        system: &System,
        split: (usize, usize),
    ) -> Result<(), String> {
        let first = self.rows.len();
        for &rate in &settings.rates {
            let row = run::run(settings, trace, system, split, rate).await?;
            eprintln!("{}", line(&row));
            self.rows.push(row);
        }
        let goodput = best(&self.rows[first..], trace, system);
        if system.roles == Roles::Fixed && !system.is_peer() {
            let name = trace.name.clone();
            self.fixed.push((name, split, goodput.goodput_rps));
        }
        self.goodput.push(goodput);
        Ok(())
    }

    /// The split on which pd-proxy's fixed roles did best on `trace` (the first of equals),
    /// none when none of them ran.
    fn best_split(&self, trace: &Trace) -> Option<(usize, usize)> {
        (self.fixed.iter())
            .filter(|(name, ..)| *name == trace.name)
            .fold(
                None,
                |best: Option<(&(usize, usize), f64)>, (_, split, goodput)| match best {
                    Some((_, most)) if most >= *goodput => best,
                    _ => Some((split, *goodput)),
                },
            )
            .map(|(split, _)| *split)
    }
}

/// The goodput of one system on one split: the highest rate of `rows` (its sweep) at which 90%
/// of requests met both targets.
fn best(rows: &[TimedRow], trace: &Trace, system: &System) -> GoodputRow {
    let met = rows.iter().filter(|row| row.attainment >= 0.9);
    let best = met.max_by(|a, b| a.offered_rps.total_cmp(&b.offered_rps));
    GoodputRow {
        trace: trace.name.clone(),
        system: system.name.to_owned(),
        split: rows.first().map_or_else(String::new, |r| r.split.clone()),
        roles: system.roles,
        peer: system.is_peer(),
        goodput_rps: best.map_or(0.0, |b| b.offered_rps),
        rate: best.map(|b| b.rate),
    }
}
