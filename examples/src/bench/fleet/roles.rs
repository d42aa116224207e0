//! The roles' verdict of a timed replay: goodput with moving roles against every fixed P:D
//! split, chosen after the fact (the best one, the median one), and the peers on the best;
//! the autoscaled fleet's engine-seconds against the best split's fixed fleet (sized for the
//! peak) at each rate, with the share of requests each kept within the targets.

use std::fmt::Write;

use serde::Serialize;

use super::systems::Roles;
use super::timed::{GoodputRow, TimedRow};
use crate::bench::chart::{grouped_bars, Series};

/// Moving roles against the fixed splits on one trace.
#[derive(Debug, Clone, Serialize)]
pub struct RolesRow {
    /// The trace.
    pub trace: String,
    /// The fleet of engines of both roles (`N both`).
    pub fleet: String,
    /// Its goodput, requests per second of GPU time.
    pub moving_rps: f64,
    /// The fixed split of most goodput (pd-proxy's best system on it).
    pub best_split: String,
    /// That goodput.
    pub best_rps: f64,
    /// The median of the fixed splits' goodputs.
    pub median_rps: f64,
    /// Each peer's goodput on the best split, `name: req/s`.
    pub peers: Vec<String>,
}

/// The autoscaled fleet against the fixed one at one rate.
#[derive(Debug, Clone, Serialize)]
pub struct AutoscaleRow {
    /// The trace.
    pub trace: String,
    /// The fleet sized for the peak (the best fixed split).
    pub split: String,
    /// The rate multiplier.
    pub rate: f64,
    /// The share within both targets, fixed fleet.
    pub fixed_attainment: f64,
    /// The share within both targets, autoscaled.
    pub autoscaled_attainment: f64,
    /// Engine-seconds of GPU time, fixed fleet.
    pub fixed_engine_seconds: f64,
    /// Engine-seconds of GPU time, autoscaled.
    pub autoscaled_engine_seconds: f64,
    /// Engines the autoscaler stopped.
    pub stops: usize,
}

/// One row per trace and fleet of engines of both roles.
pub fn roles_rows(goodput: &[GoodputRow]) -> Vec<RolesRow> {
    let moving = goodput.iter().filter(|g| g.roles == Roles::Moving);
    (moving.map(|m| {
        let fixed = fixed_by_split(goodput, &m.trace);
        let best = (fixed.iter()).fold(None, |best: Option<&(String, f64)>, each| match best {
            Some(b) if b.1 >= each.1 => best,
            _ => Some(each),
        });
        let best_split = best.map_or_else(String::new, |b| b.0.clone());
        let peers = (goodput.iter())
            .filter(|g| g.peer && g.trace == m.trace && g.split == best_split)
            .map(|g| format!("{}: {:.2}", g.system, g.goodput_rps))
            .collect();
        RolesRow {
            trace: m.trace.clone(),
            fleet: m.split.clone(),
            moving_rps: m.goodput_rps,
            best_rps: best.map_or(0.0, |b| b.1),
            best_split,
            median_rps: median(fixed.iter().map(|(_, rps)| *rps).collect()),
            peers,
        }
    }))
    .collect()
}

/// pd-proxy's best fixed-role goodput on each split of `trace`, in the order swept.
fn fixed_by_split(goodput: &[GoodputRow], trace: &str) -> Vec<(String, f64)> {
    let mut splits: Vec<(String, f64)> = Vec::new();
    let fixed = (goodput.iter()).filter(|g| g.roles == Roles::Fixed && !g.peer && g.trace == trace);
    for row in fixed {
        match splits.iter_mut().find(|(split, _)| *split == row.split) {
            Some((_, most)) => *most = most.max(row.goodput_rps),
            None => splits.push((row.split.clone(), row.goodput_rps)),
        }
    }
    splits
}

/// The median (the mean of the middle two of an even count), 0 of nothing.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// One row per autoscaled run beside the fixed run of most attainment on its split and rate.
pub fn autoscale_rows(rows: &[TimedRow]) -> Vec<AutoscaleRow> {
    let scaled = rows.iter().filter(|r| r.roles == Roles::Autoscaled);
    (scaled.filter_map(|a| {
        let fixed = (rows.iter())
            .filter(|r| r.roles == Roles::Fixed && !r.peer && r.trace == a.trace)
            .filter(|r| r.split == a.split && r.rate == a.rate)
            .max_by(|x, y| x.attainment.total_cmp(&y.attainment))?;
        Some(AutoscaleRow {
            trace: a.trace.clone(),
            split: a.split.clone(),
            rate: a.rate,
            fixed_attainment: fixed.attainment,
            autoscaled_attainment: a.attainment,
            fixed_engine_seconds: fixed.engine_seconds,
            autoscaled_engine_seconds: a.engine_seconds,
            stops: a.stops,
        })
    }))
    .collect()
}

/// The roles' rows as a Markdown table.
pub fn roles_table(rows: &[RolesRow]) -> String {
    let mut out = String::from(
        "| trace | moving roles | goodput req/s | best fixed split | its goodput | median fixed | \
         vs best | vs median | peers on the best split |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    let ratio = |a: f64, b: f64| match b > 0.0 {
        true => format!("{:.2}x", a / b),
        false => "n/a".to_owned(),
    };
    for row in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {:.2} | {} | {:.2} | {:.2} | {} | {} | {} |",
            row.trace,
            row.fleet,
            row.moving_rps,
            row.best_split,
            row.best_rps,
            row.median_rps,
            ratio(row.moving_rps, row.best_rps),
            ratio(row.moving_rps, row.median_rps),
            row.peers.join(", "),
        );
    }
    out
}

/// The autoscaler's rows as a Markdown table.
pub fn autoscale_table(rows: &[AutoscaleRow]) -> String {
    let mut out = String::from(
        "| trace | fleet for the peak | rate | within targets, fixed | autoscaled | engine-s, \
         fixed | autoscaled | saved | engines stopped |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for row in rows {
        let saved = 1.0 - row.autoscaled_engine_seconds / row.fixed_engine_seconds.max(1e-9);
        let _ = writeln!(
            out,
            "| {} | {} | {}x | {:.1}% | {:.1}% | {:.0} | {:.0} | {:.1}% | {} |",
            row.trace,
            row.split,
            row.rate,
            row.fixed_attainment * 100.0,
            row.autoscaled_attainment * 100.0,
            row.fixed_engine_seconds,
            row.autoscaled_engine_seconds,
            saved * 100.0,
            row.stops,
        );
    }
    out
}

/// Goodput of every fixed split, the moving roles and the peers, one bar per trace.
pub fn roles_chart(goodput: &[GoodputRow]) -> Result<String, String> {
    let label = |g: &GoodputRow| match (g.roles, g.peer) {
        (Roles::Fixed, false) => format!("fixed {}", g.split),
        (Roles::Moving, _) => format!("moving, {}", g.split),
        _ => format!("{} {}", g.system, g.split),
    };
    let shown = || (goodput.iter()).filter(|g| g.roles != Roles::Autoscaled);
    let mut categories: Vec<String> = Vec::new();
    let mut traces: Vec<String> = Vec::new();
    for row in shown() {
        let category = label(row);
        if !categories.contains(&category) {
            categories.push(category);
        }
        if !traces.contains(&row.trace) {
            traces.push(row.trace.clone());
        }
    }
    let series: Vec<Series> = (traces.into_iter())
        .map(|trace| Series {
            values: (categories.iter())
                .map(|category| {
                    (shown().filter(|g| g.trace == trace && label(g) == *category))
                        .map(|g| g.goodput_rps)
                        .fold(0.0, f64::max)
                })
                .collect(),
            name: trace,
        })
        .collect();
    grouped_bars(
        "Goodput: fixed P:D splits, moving roles, peers",
        "requests/s",
        &categories,
        &series,
    )
}

/// Engine-seconds of the fixed and the autoscaled fleet, a group per trace and rate.
pub fn autoscale_chart(rows: &[AutoscaleRow]) -> Result<String, String> {
    // The rate and the shares within targets first: a long trace name is cut short.
    let categories: Vec<String> = (rows.iter())
        .map(|r| {
            format!(
                "{}x, {:.1}% / {:.1}% within, {}",
                r.rate,
                r.fixed_attainment * 100.0,
                r.autoscaled_attainment * 100.0,
                r.trace
            )
        })
        .collect();
    let series = [
        Series {
            name: "fixed, sized for the peak".to_owned(),
            values: rows.iter().map(|r| r.fixed_engine_seconds).collect(),
        },
        Series {
            name: "autoscaled by the planner".to_owned(),
            values: rows.iter().map(|r| r.autoscaled_engine_seconds).collect(),
        },
    ];
    grouped_bars(
        "Engine-seconds: fixed fleet against the planner's",
        "engine-seconds",
        &categories,
        &series,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn goodput(system: &str, split: &str, roles: Roles, peer: bool, rps: f64) -> GoodputRow {
        GoodputRow {
            trace: "t".into(),
            system: system.into(),
            split: split.into(),
            roles,
            peer,
            goodput_rps: rps,
            rate: Some(1.0),
        }
    }

    #[test]
    fn moving_roles_are_set_against_the_best_and_the_median_fixed_split() {
        let rows = [
            goodput("a", "1:3", Roles::Fixed, false, 1.0),
            goodput("b", "1:3", Roles::Fixed, false, 2.0),
            goodput("a", "2:2", Roles::Fixed, false, 4.0),
            goodput("a", "3:1", Roles::Fixed, false, 3.0),
            goodput("peer", "2:2", Roles::Fixed, true, 3.5),
            goodput("peer", "3:1", Roles::Fixed, true, 9.0),
            goodput("m", "4 both", Roles::Moving, false, 5.0),
        ];
        let verdict = roles_rows(&rows);
        assert_eq!(verdict.len(), 1);
        let row = &verdict[0];
        assert_eq!((row.best_split.as_str(), row.best_rps), ("2:2", 4.0));
        // Per split, the best fixed system: 2, 4, 3; their median 3.
        assert_eq!(row.median_rps, 3.0);
        assert_eq!(row.peers, ["peer: 3.50"]);
        assert!(roles_table(&verdict).contains("| 1.25x | 1.67x |"));
        assert_eq!(median(vec![1.0, 4.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(Vec::new()), 0.0);
    }
}
