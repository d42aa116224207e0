//! The timed replay's tables: a row per run, goodput per system and split.

use super::{GoodputRow, TimedRow};

/// A row as a line of [`table`].
pub fn line(row: &TimedRow) -> String {
    format!(
        "| {} | {} | {} | {} | {:.2} | {} | {} | {} | {} | {:.1}% | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {:.1}% | {:.2} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.0} | {} |",
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
        row.engine_seconds,
        row.role_changes,
    )
}

/// The rows as a Markdown table.
pub fn table(rows: &[TimedRow]) -> String {
    let mut out = String::from(
        "| trace | system | P:D | rate | offered req/s | requests | complete | refused | failed | \
         within targets | TTFT p50 ms | p90 | p99 | TPOT p50 ms | p90 | prefix hit rate | \
         prefill spread | lag p99 ms | lag max ms | sim CPU ms/req | sims' cores | front CPU \
         ms/req | engine-seconds | duty changes |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
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
