//! `pd-bench fleet`: public production traces (`../shared/bench/traces/`) replayed on a fleet.
//! First order-only ([`order_only`]): each routing rule's prefix hit rate and load spread,
//! checked against the traces' oracle (`cache_sim.py`), before any timing; then, with
//! `--timed`, the timed replay ([`timed`]): the trace open-loop ([`replay`], prompts from its
//! block ids by [`prompts`]) through each system ([`systems`]) on a fleet of modelled
//! sim-engines, the bench actuating the planner's desired engines for the autoscaled one
//! ([`autoscale`]), and the verdict on moving roles and autoscaling ([`roles`]). [`trace`]
//! reads and checks the traces (and joins them into one whose shape shifts, with `--shift`);
//! [`python_random`] draws the oracle's random numbers.

pub mod autoscale;
pub mod order_only;
pub mod prompts;
pub mod python_random;
pub mod replay;
pub mod roles;
pub mod systems;
pub mod timed;
pub mod trace;

use std::fmt::Write;
use std::path::PathBuf;
use std::time::Duration;

use order_only::{Fleet, OrderOnlyRow, Rule};
use trace::Trace;

use super::chart::{grouped_bars, Series};
use super::output::Output;

/// The capacities of the one-cache curve (the Mooncake paper's Fig. 9), in tokens.
pub const ONE_CACHE_TOKENS: [u64; 7] = [
    100_000,
    1_000_000,
    3_000_000,
    10_000_000,
    30_000_000,
    50_000_000,
    1_000_000_000,
];

/// What `pd-bench fleet` replays, and on what.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The traces.
    pub traces: Vec<PathBuf>,
    /// The window of each trace replayed: from this arrival ...
    pub from: Duration,
    /// ... to this one (the whole trace when none).
    pub to: Option<Duration>,
    /// The engines and their caches.
    pub fleet: Fleet,
    /// The windows joined back to back into one trace, each at its own rate multiplier (in
    /// the traces' order; none given: each at its own rate), instead of replayed one by one.
    pub shift: Option<Vec<f64>>,
    /// The timed replay after the order-only one, when asked.
    pub timed: Option<timed::TimedSettings>,
}

/// Reads every trace (all of them, before anything is replayed: a bad line stops the run),
/// then writes each one's order-only section, then the timed replay's.
pub async fn section(out: &mut Output, settings: &Settings) -> Result<(), String> {
    let traces = (settings.traces.iter())
        .map(|path| {
            let trace = Trace::read(path).map_err(|err| err.to_string())?;
            let window = trace.window(settings.from, settings.to);
            match window.requests.is_empty() {
                true => Err(format!(
                    "{}: no request arrives in the window",
                    path.display()
                )),
                false => Ok(window),
            }
        })
        .collect::<Result<Vec<Trace>, String>>()?;
    let traces = match &settings.shift {
        Some(rates) => vec![shifted(&traces, rates, settings)?],
        None => traces,
    };
    let fleet = settings.fleet;
    out.text(&format!(
        "Order-only replay (no timing): each request in arrival order on the engine its rule \
         picks, each engine's prefix cache an LRU set of the trace's blocks. Hit rate: prompt \
         tokens found in the chosen engine's cache over all prompt tokens; imbalance: the most \
         prompt tokens one engine computed over the mean. {} engines of {} cached tokens each; \
         the bounded rule's slack {}, the random rule's seed {}.\n\n",
        fleet.engines, fleet.cache_tokens, fleet.eps, fleet.seed
    ));
    let mut by_rule = Vec::new();
    let mut one_cache = Vec::new();
    for trace in &traces {
        if !trace.has_blocks() {
            out.text(&format!(
                "{}: {} requests, no prefix data (every hit rate would be 0); skipped.\n\n",
                trace.name,
                trace.requests.len()
            ));
            continue;
        }
        by_rule.extend(Rule::ALL.map(|rule| order_only::replay(trace, fleet, rule)));
        one_cache.extend(ONE_CACHE_TOKENS.map(|cache_tokens| {
            let one = Fleet {
                engines: 1,
                cache_tokens,
                ..fleet
            };
            order_only::replay(trace, one, Rule::RoundRobin)
        }));
    }
    out.section(
        "fleet-order",
        &rules_table(&by_rule),
        &by_rule,
        vec![("fleet-order", rules_chart(&by_rule)?)],
    )?;
    out.text("\nOne engine, hit rate by its cache's size (tokens):\n\n");
    out.section(
        "fleet-one-cache",
        &capacity_table(&one_cache),
        &one_cache,
        Vec::new(),
    )?;
    match &settings.timed {
        Some(timed) => timed_sections(out, timed, &traces).await,
        None => Ok(()),
    }
}

/// The windows of `traces` one after the other, each `rates[i]` times as fast: a window
/// lasts `--to` minus `--from` (its last arrival and a second without `--to`).
fn shifted(traces: &[Trace], rates: &[f64], settings: &Settings) -> Result<Trace, String> {
    let ones = vec![1.0; traces.len()];
    let rates = if rates.is_empty() { &ones[..] } else { rates };
    if rates.len() != traces.len() {
        return Err(format!(
            "--shift has {} rates for {} traces: one each",
            rates.len(),
            traces.len()
        ));
    }
    let length = |trace: &Trace| match settings.to {
        Some(to) => to.saturating_sub(settings.from),
        None => trace.requests.last().map_or(Duration::ZERO, |r| r.at) + Duration::from_secs(1),
    };
    let mut parts = traces.iter().zip(rates);
    let (first, &rate) = parts.next().ok_or("--shift needs a trace")?;
    let mut joined = first.sped(rate);
    let mut end = length(first).div_f64(rate);
    for (trace, &rate) in parts {
        joined = joined.then(&trace.sped(rate), end)?;
        end += length(trace).div_f64(rate);
    }
    Ok(joined)
}

/// The timed replay of every trace: its rows, then goodput, with their charts.
async fn timed_sections(
    out: &mut Output,
    settings: &timed::TimedSettings,
    traces: &[Trace],
) -> Result<(), String> {
    let model = settings.preset.coefficients();
    out.text(&format!(
        "\nTimed replay: each trace's arrivals open-loop at its own timestamps times the rate, \
         through each system on a fresh fleet of each P:D split ({}), sim-engines with \
         the engine model `{:?}` ({} KV tokens and prefix cache each) run {}x faster than that \
         GPU, the arrivals as much faster; times are the measured ones times {} (so the \
         proxy's and loopback's part is scaled too). Targets: TTFT {} ms, TPOT {} ms; goodput \
         is the highest rate swept ({:?}) at which 90% of requests meet both. KV moves over \
         loopback at 4 bytes a token: its transfer time is not modelled.\n\n",
        (settings.splits.iter())
            .map(|(p, d)| format!("{p}:{d}"))
            .collect::<Vec<_>>()
            .join(", "),
        settings.preset,
        model.kv_capacity_tokens,
        settings.time_scale,
        settings.time_scale,
        settings.ttft_slo.as_millis(),
        settings.tpot_slo.as_millis(),
        settings.rates,
    ));
    let (rows, goodput) = timed::rows(settings, traces).await?;
    out.section(
        "fleet-timed",
        &timed::table(&rows),
        &rows,
        vec![("fleet-ttft", ttft_chart(&rows)?)],
    )?;
    out.text("\nGoodput (requests per second of GPU time):\n\n");
    out.section(
        "fleet-goodput",
        &timed::goodput_table(&goodput),
        &goodput,
        vec![("fleet-goodput", goodput_chart(&goodput)?)],
    )?;
    let moving = roles::roles_rows(&goodput);
    if !moving.is_empty() {
        out.text(
            "\nMoving roles against the fixed splits, chosen after the fact (each split's \
             goodput is pd-proxy's best fixed-role system's on it):\n\n",
        );
        let chart = roles::roles_chart(&goodput)?;
        let table = roles::roles_table(&moving);
        out.section("fleet-roles", &table, &moving, vec![("fleet-roles", chart)])?;
    }
    let scaled = roles::autoscale_rows(&rows);
    if !scaled.is_empty() {
        out.text(&format!(
            "\nThe planner's desired engines actuated by the bench (one fewer desired after {} s \
             of GPU time with the survivors meeting the targets, drained, then frozen once idle; \
             one too few thawed and in rotation {} s later) against the same fleet fixed, sized \
             for the peak:\n\n",
            settings.scale_down_after.as_secs_f64(),
            settings.start_delay.as_secs_f64()
        ));
        let chart = roles::autoscale_chart(&scaled)?;
        let table = roles::autoscale_table(&scaled);
        out.section(
            "fleet-autoscale",
            &table,
            &scaled,
            vec![("fleet-autoscale", chart)],
        )?;
    }
    Ok(())
}

/// Names in first-seen order.
fn distinct<'a>(names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut seen: Vec<String> = Vec::new();
    for name in names {
        if !seen.iter().any(|s| s == name) {
            seen.push(name.to_owned());
        }
    }
    seen
}

/// TTFT p90 of each system (a group each), one bar per trace and rate.
fn ttft_chart(rows: &[timed::TimedRow]) -> Result<String, String> {
    let systems = distinct(rows.iter().map(|r| r.system.as_str()));
    let splits = distinct(rows.iter().map(|r| r.split.as_str()));
    let label = |system: &str, split: &str| match splits.len() {
        1 => system.to_owned(),
        _ => format!("{system} {split}"),
    };
    let groups: Vec<(String, String)> = (systems.iter())
        .flat_map(|system| {
            splits
                .iter()
                .map(move |split| (system.clone(), split.clone()))
        })
        .collect();
    let runs = distinct(rows.iter().map(|r| r.trace.as_str()));
    let mut series = Vec::new();
    for trace in &runs {
        let mut rates: Vec<f64> = Vec::new();
        for row in rows.iter().filter(|r| &r.trace == trace) {
            if !rates.contains(&row.rate) {
                rates.push(row.rate);
            }
        }
        for rate in rates {
            let values = (groups.iter())
                .map(|(system, split)| {
                    (rows.iter())
                        .find(|r| {
                            &r.system == system
                                && &r.split == split
                                && &r.trace == trace
                                && r.rate == rate
                        })
                        .map_or(0.0, |r| r.ttft_p90_ms)
                })
                .collect();
            series.push(Series {
                name: format!("{trace} at {rate}x"),
                values,
            });
        }
    }
    let categories: Vec<String> = groups.iter().map(|(s, p)| label(s, p)).collect();
    grouped_bars(
        "TTFT p90 by system (trace replay)",
        "ms",
        &categories,
        &series,
    )
}

/// Goodput of each system on each split (a group each), one bar per trace.
fn goodput_chart(rows: &[timed::GoodputRow]) -> Result<String, String> {
    let splits = distinct(rows.iter().map(|r| r.split.as_str()));
    let label = |row: &timed::GoodputRow| match splits.len() {
        1 => row.system.clone(),
        _ => format!("{} {}", row.system, row.split),
    };
    let groups = distinct(
        rows.iter()
            .map(label)
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str),
    );
    let series = distinct(rows.iter().map(|r| r.trace.as_str()))
        .into_iter()
        .map(|trace| Series {
            values: (groups.iter())
                .map(|group| {
                    (rows.iter())
                        .find(|r| label(r) == *group && r.trace == trace)
                        .map_or(0.0, |r| r.goodput_rps)
                })
                .collect(),
            name: trace,
        })
        .collect::<Vec<_>>();
    grouped_bars(
        "Goodput by system (trace replay)",
        "requests/s",
        &groups,
        &series,
    )
}

/// Hit rate and imbalance per trace and rule.
pub fn rules_table(rows: &[OrderOnlyRow]) -> String {
    let mut out = String::from(
        "| trace | rule | engines | cache tokens each | requests | hit rate | imbalance |\n\
         |---|---|---|---|---|---|---|\n",
    );
    for row in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {:.4} | {:.2} |",
            row.trace,
            row.rule.name(),
            row.engines,
            row.cache_tokens,
            row.requests,
            row.hit_rate,
            row.imbalance
        );
    }
    out
}

/// One engine's hit rate per trace and cache size.
fn capacity_table(rows: &[OrderOnlyRow]) -> String {
    let mut out = String::from("| trace | cache tokens | hit rate |\n|---|---|---|\n");
    for row in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {:.4} |",
            row.trace, row.cache_tokens, row.hit_rate
        );
    }
    out
}

/// The hit rate of each rule (a group each), one bar per trace.
fn rules_chart(rows: &[OrderOnlyRow]) -> Result<String, String> {
    let categories: Vec<String> = Rule::ALL.iter().map(|r| r.name().to_owned()).collect();
    let mut traces: Vec<&str> = rows.iter().map(|r| r.trace.as_str()).collect();
    traces.dedup();
    let series: Vec<Series> = (traces.iter())
        .map(|&trace| Series {
            name: trace.to_owned(),
            values: (Rule::ALL.iter())
                .map(|&rule| {
                    (rows.iter())
                        .find(|r| r.trace == trace && r.rule == rule)
                        .map_or(0.0, |r| r.hit_rate)
                })
                .collect(),
        })
        .collect();
    grouped_bars(
        "Prefix hit rate by routing rule (order only)",
        "hit rate",
        &categories,
        &series,
    )
}
