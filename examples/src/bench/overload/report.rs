//! The overload runs' report: each system's row at each load (goodput, interactive TTFT,
//! refusals by class, the tenants' fairness), as a Markdown table and three charts.

use super::{Class, Outcome};
use crate::bench::chart::{grouped_bars, Series};

/// One system at one load.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OverloadRow {
    /// The system.
    pub system: String,
    /// The load, as a multiple of capacity.
    pub load: f64,
    /// Requests sent per second.
    pub offered: f64,
    /// Answers within their class's TTFT target, per second of arrivals.
    pub goodput: f64,
    /// Interactive TTFT p50 (answered ones), ms.
    pub interactive_p50_ms: f64,
    /// Interactive TTFT p99, ms.
    pub interactive_p99_ms: f64,
    /// Interactive requests answered within 500 ms, of all sent.
    pub interactive_met: f64,
    /// Refused (429) per class, of each class's requests.
    pub shed_interactive: f64,
    /// Standard requests refused.
    pub shed_standard: f64,
    /// Batch requests refused.
    pub shed_batch: f64,
    /// Other failures (errors, timeouts), of all requests.
    pub failed: f64,
    /// Jain's index of the tenants' standard answers within target over their max-min fair
    /// shares of all such answers (1: exactly max-min fair).
    pub jain: f64,
    /// The quiet tenants' standard requests answered within target, of those sent.
    pub quiet_met: f64,
    /// The noisy tenant's standard requests answered within target, of those sent.
    pub noisy_met: f64,
}

/// One row from a run's outcomes: `system` at `load` (`rate` requests per second),
/// `seconds` of arrivals counted.
pub(super) fn summarize(
    system: &str,
    load: f64,
    rate: f64,
    seconds: f64,
    outcomes: &[Outcome],
) -> OverloadRow {
    let of = |class: Class| outcomes.iter().filter(move |o| o.class == class);
    let share = |n: usize, of: usize| n as f64 / of.max(1) as f64;
    let ok = |o: &&Outcome| o.status == 200;
    let met = outcomes
        .iter()
        .filter(|o| o.status == 200 && o.ttft <= o.class.target())
        .count();
    let mut interactive: Vec<f64> = (of(Class::Interactive).filter(ok))
        .map(|o| o.ttft.as_secs_f64() * 1e3)
        .collect();
    interactive.sort_by(f64::total_cmp);
    let at = |q: f64| match interactive.is_empty() {
        true => f64::NAN,
        false => interactive[((interactive.len() - 1) as f64 * q).round() as usize],
    };
    let shed = |class: Class| {
        share(
            of(class).filter(|o| o.status == 429).count(),
            of(class).count(),
        )
    };
    let failed = (outcomes.iter())
        .filter(|o| o.status != 200 && o.status != 429)
        .count();
    let interactive_met = of(Class::Interactive)
        .filter(|o| o.status == 200 && o.ttft <= Class::Interactive.target())
        .count();
    let tenants = 4;
    let sent: Vec<f64> = (0..tenants)
        .map(|t| of(Class::Standard).filter(|o| o.tenant == t).count() as f64)
        .collect();
    // What each tenant got of what it asked: its standard answers within target.
    let in_time = |o: &&Outcome| o.status == 200 && o.ttft <= o.class.target();
    let served: Vec<f64> = (0..tenants)
        .map(|t| {
            of(Class::Standard)
                .filter(|o| o.tenant == t)
                .filter(in_time)
                .count() as f64
        })
        .collect();
    let total: f64 = served.iter().sum();
    let quiet_sent: f64 = sent[1..].iter().sum();
    let quiet_met: f64 = served[1..].iter().sum();
    OverloadRow {
        system: system.to_owned(),
        load,
        offered: rate,
        goodput: met as f64 / seconds,
        interactive_p50_ms: at(0.5),
        interactive_p99_ms: at(0.99),
        interactive_met: share(interactive_met, of(Class::Interactive).count()),
        shed_interactive: shed(Class::Interactive),
        shed_standard: shed(Class::Standard),
        shed_batch: shed(Class::Batch),
        failed: share(failed, outcomes.len()),
        jain: jain(&served, &max_min_fair(&sent, total)),
        quiet_met: quiet_met / quiet_sent.max(1.0),
        noisy_met: served[0] / sent[0].max(1.0),
    }
}

/// The max-min fair shares of `capacity` among `demands` (water-filling).
pub(super) fn max_min_fair(demands: &[f64], capacity: f64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..demands.len()).collect();
    order.sort_by(|a, b| demands[*a].total_cmp(&demands[*b]));
    let (mut left, mut shares) = (capacity, vec![0.0; demands.len()]);
    for (k, &i) in order.iter().enumerate() {
        let even = left / (order.len() - k) as f64;
        shares[i] = demands[i].min(even);
        left -= shares[i];
    }
    shares
}

/// Jain's fairness index of `got` normalized by `fair` (1: exactly fair).
pub(super) fn jain(got: &[f64], fair: &[f64]) -> f64 {
    let x: Vec<f64> = (got.iter().zip(fair))
        .filter(|(_, fair)| **fair > 0.0)
        .map(|(got, fair)| got / fair)
        .collect();
    let (sum, squares): (f64, f64) = (x.iter().sum(), x.iter().map(|v| v * v).sum());
    match squares > 0.0 {
        true => sum * sum / (x.len() as f64 * squares),
        false => 1.0,
    }
}

/// The row as a line of the Markdown table.
pub(super) fn line(row: &OverloadRow) -> String {
    let percent = |v: f64| format!("{:.0}%", v * 100.0);
    format!(
        "| {} | {:.0}x | {:.0} | {:.1} | {:.0} | {:.0} | {} | {} / {} / {} | {} | {:.2} | {} / {} |",
        row.system,
        row.load,
        row.offered,
        row.goodput,
        row.interactive_p50_ms,
        row.interactive_p99_ms,
        percent(row.interactive_met),
        percent(row.shed_interactive),
        percent(row.shed_standard),
        percent(row.shed_batch),
        percent(row.failed),
        row.jain,
        percent(row.quiet_met),
        percent(row.noisy_met),
    )
}

/// The rows as a Markdown table.
pub fn table(rows: &[OverloadRow]) -> String {
    let mut out = String::from(
        "| system | load | offered req/s | goodput req/s | interactive TTFT p50 ms | p99 ms | interactive within 500 ms | refused: interactive / standard / batch | failed | Jain (standard) | standard within 5 s: quiet / noisy tenants |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for row in rows {
        out.push_str(&line(row));
        out.push('\n');
    }
    out
}

/// Goodput, interactive TTFT p99 and fairness per system, a bar per load.
pub fn charts(rows: &[OverloadRow]) -> Result<Vec<(&'static str, String)>, String> {
    let mut systems: Vec<String> = Vec::new();
    let mut loads: Vec<f64> = Vec::new();
    for row in rows {
        if !systems.contains(&row.system) {
            systems.push(row.system.clone());
        }
        if !loads.contains(&row.load) {
            loads.push(row.load);
        }
    }
    let series = |value: fn(&OverloadRow) -> f64| -> Vec<Series> {
        (loads.iter())
            .map(|load| Series {
                name: format!("{load}x capacity"),
                values: (systems.iter())
                    .map(|system| {
                        (rows.iter())
                            .find(|r| &r.system == system && r.load == *load)
                            .map_or(0.0, value)
                    })
                    .collect(),
            })
            .collect()
    };
    Ok(vec![
        (
            "overload-goodput",
            grouped_bars(
                "Goodput under overload (answers within their target)",
                "req/s",
                &systems,
                &series(|r| r.goodput),
            )?,
        ),
        (
            "overload-interactive-ttft",
            grouped_bars(
                "Interactive TTFT p99 (target 500 ms)",
                "ms",
                &systems,
                &series(|r| r.interactive_p99_ms),
            )?,
        ),
        (
            "overload-fairness",
            grouped_bars(
                "Tenants' fairness on standard traffic (Jain's index, 1 = max-min fair)",
                "index",
                &systems,
                &series(|r| r.jain),
            )?,
        ),
    ])
}
