//! One row per measured run, rendered as a Markdown table.

use std::fmt::Write;
use std::time::Duration;

use super::chart::{grouped_bars, Series};
use super::loadgen::{LoadReport, ProcessUsage};

/// One measured run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    /// What was measured (`bootstrap GET /query (64 workers)`, `proxy streaming`...).
    pub scenario: String,
    /// Which system served it (`pd-bootstrap`, `vllm-router`, `direct`...).
    pub system: String,
    /// Concurrent connections.
    pub concurrency: usize,
    /// Successful requests per second.
    pub rps: f64,
    /// Latency quantiles in ms.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// Failed requests.
    pub errors: u64,
    /// CPU of the server under test per successful request.
    pub cpu_us_per_request: Option<f64>,
    /// The kernel's part of `cpu_us_per_request` (system calls and their TCP traffic).
    pub kernel_us_per_request: Option<f64>,
    /// Context switches of the server under test's threads per successful request ...
    pub switches_per_request: Option<f64>,
    /// ... of which wake-ups (voluntary switches: a thread waited and was woken).
    pub wakeups_per_request: Option<f64>,
    /// Peak RSS of the server under test.
    pub peak_rss_mib: Option<f64>,
}

impl Row {
    /// A row from a load report and the server's usage before and after the run.
    pub fn new(
        scenario: &str,
        system: &str,
        concurrency: usize,
        report: &LoadReport,
        before: Option<ProcessUsage>,
        after: Option<ProcessUsage>,
    ) -> Self {
        let per_request = |amount: fn(&ProcessUsage) -> f64| match (before, after) {
            (Some(b), Some(a)) if report.ok > 0 => {
                Some((amount(&a) - amount(&b)).max(0.0) / report.ok as f64)
            }
            _ => None,
        };
        fn micros(time: Duration) -> f64 {
            time.as_secs_f64() * 1e6
        }
        Row {
            scenario: scenario.to_owned(),
            system: system.to_owned(),
            concurrency,
            rps: report.rps(),
            p50_ms: report.quantile_ms(0.5),
            p99_ms: report.quantile_ms(0.99),
            p999_ms: report.quantile_ms(0.999),
            errors: report.errors,
            cpu_us_per_request: per_request(|u| micros(u.cpu)),
            kernel_us_per_request: per_request(|u| micros(u.kernel)),
            switches_per_request: per_request(|u| u.switches as f64),
            wakeups_per_request: per_request(|u| u.wakeups as f64),
            peak_rss_mib: after.map(|a| a.peak_rss as f64 / (1024.0 * 1024.0)),
        }
    }

    /// The row as one Markdown table line.
    pub fn markdown(&self) -> String {
        let opt =
            |v: Option<f64>, digits: usize| v.map_or("-".to_owned(), |v| format!("{v:.digits$}"));
        format!(
            "| {} | {} | {} | {:.0} | {:.3} | {:.3} | {:.3} | {} | {} | {} | {} | {} | {} |",
            self.scenario,
            self.system,
            self.concurrency,
            self.rps,
            self.p50_ms,
            self.p99_ms,
            self.p999_ms,
            self.errors,
            opt(self.cpu_us_per_request, 1),
            opt(self.kernel_us_per_request, 1),
            opt(self.switches_per_request, 3),
            opt(self.wakeups_per_request, 3),
            opt(self.peak_rss_mib, 1),
        )
    }
}

/// The table header.
pub const HEADER: &str = "| scenario | system | conc. | req/s | p50 ms | p99 ms | p99.9 ms | errors | server CPU µs/req | of which kernel | context switches/req | of which wake-ups | server peak RSS MiB |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|";

/// A Markdown table of `rows`.
/// Requests per second of every (scenario, system), one bar per concurrency level, as SVG.
pub fn chart(title: &str, rows: &[Row]) -> Result<String, String> {
    let mut categories: Vec<String> = Vec::new();
    let mut levels: Vec<usize> = Vec::new();
    for row in rows {
        let category = format!("{} / {}", row.scenario, row.system);
        if !categories.contains(&category) {
            categories.push(category);
        }
        if !levels.contains(&row.concurrency) {
            levels.push(row.concurrency);
        }
    }
    let series: Vec<Series> = levels
        .iter()
        .map(|&level| Series {
            name: format!("c={level}"),
            values: categories
                .iter()
                .map(|category| {
                    rows.iter()
                        .find(|r| {
                            r.concurrency == level
                                && format!("{} / {}", r.scenario, r.system) == *category
                        })
                        .map_or(0.0, |r| r.rps)
                })
                .collect(),
        })
        .collect();
    grouped_bars(title, "requests per second", &categories, &series)
}

/// The rows as a Markdown table.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from(HEADER);
    for row in rows {
        let _ = write!(out, "\n{}", row.markdown());
    }
    out.push('\n');
    out
}
