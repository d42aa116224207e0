//! Watch fan-out: how long a change takes to reach every watcher of a bootstrap server, for
//! growing numbers of watchers (each a client of its own, long-polling `GET /watch` as pd-proxy
//! and the worker-client's directory do).

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use pd_protocol::vllm::RegisterWorker;
use tokio::sync::mpsc;
use worker_client::{BootstrapClient, WatchUpdate};

use super::bootstrap::{BenchServer, Measured, Settings};
use super::chart::{grouped_bars, Series};

/// Changes timed per number of watchers.
const ROUNDS: usize = 5;

/// One number of watchers.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FanoutRow {
    /// Watchers following the server.
    pub watchers: usize,
    /// Median over the rounds of the time from a registration's start to the median watcher
    /// seeing it, ms.
    pub median_watcher_ms: f64,
    /// The same to the last watcher, ms.
    pub last_watcher_ms: f64,
    /// The registration's own time (until it is durable and answered), median, ms.
    pub write_ms: f64,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// For each number in `watchers`: a fresh server, that many watchers, then [`ROUNDS`]
/// registrations, each timed until every watcher has seen it.
pub async fn fanout(settings: &Settings, watchers: &[usize]) -> Result<Vec<FanoutRow>, String> {
    let mut rows = Vec::new();
    for &n in watchers {
        let data_dir = settings.data_dir(&format!("watch-{n}"));
        let server = BenchServer::start(settings, &data_dir, &format!("bench-watch-{n}")).await?;
        let url = format!("http://{}", server.addr());
        let (ready_tx, mut ready) = mpsc::unbounded_channel::<()>();
        let (seen_tx, mut seen) = mpsc::unbounded_channel::<Instant>();
        let mut tasks = Vec::new();
        for _ in 0..n {
            let client = BootstrapClient::new(&url).map_err(|e| e.to_string())?;
            let (ready_tx, seen_tx) = (ready_tx.clone(), seen_tx.clone());
            tasks.push(tokio::spawn(async move {
                let mut updates = client.watch(None);
                while let Some(Ok(update)) = updates.next().await {
                    let sent = match update {
                        WatchUpdate::Snapshot(_) => ready_tx.send(()).is_ok(),
                        WatchUpdate::Events(_) => seen_tx.send(Instant::now()).is_ok(),
                    };
                    if !sent {
                        break;
                    }
                }
            }));
        }
        let within = |what: String| move |_| format!("{what} within 60 s ({n} watchers)");
        for _ in 0..n {
            tokio::time::timeout(Duration::from_secs(60), ready.recv())
                .await
                .map_err(within("the watchers did not start".into()))?;
        }
        let writer = BootstrapClient::new(&url).map_err(|e| e.to_string())?;
        let (mut median_ms, mut last_ms, mut write_ms) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..ROUNDS as u32 {
            let started = Instant::now();
            writer
                .register_worker(&RegisterWorker {
                    engine_id: format!("fanout-{round}"),
                    dp_rank: round,
                    addr: format!("tcp://10.0.0.1:{}", 20000 + round),
                    ..RegisterWorker::default()
                })
                .await
                .map_err(|e| e.to_string())?;
            write_ms.push(started.elapsed().as_secs_f64() * 1e3);
            let mut arrivals = Vec::with_capacity(n);
            while arrivals.len() < n {
                let at = tokio::time::timeout(Duration::from_secs(60), seen.recv())
                    .await
                    .map_err(within("a change did not reach every watcher".into()))?
                    .ok_or("the watchers stopped")?;
                arrivals.push(at.duration_since(started).as_secs_f64() * 1e3);
            }
            arrivals.sort_by(f64::total_cmp);
            median_ms.push(arrivals[n / 2]);
            last_ms.push(arrivals[n - 1]);
        }
        for task in tasks {
            task.abort();
        }
        server.stop().await;
        let row = FanoutRow {
            watchers: n,
            median_watcher_ms: median(median_ms),
            last_watcher_ms: median(last_ms),
            write_ms: median(write_ms),
        };
        eprintln!("{}", line(&row));
        rows.push(row);
    }
    Ok(rows)
}

fn line(row: &FanoutRow) -> String {
    format!(
        "| {} | {:.2} | {:.2} | {:.2} |",
        row.watchers, row.write_ms, row.median_watcher_ms, row.last_watcher_ms
    )
}

/// The rows as a Markdown table.
pub fn table(rows: &[FanoutRow]) -> String {
    let mut out = String::from(
        "| watchers | registration ms | to the median watcher ms | to the last watcher ms |\n\
         |---|---|---|---|\n",
    );
    for row in rows {
        out.push_str(&line(row));
        out.push('\n');
    }
    out
}

/// The time to the median and to the last watcher per number of watchers, as SVG.
pub fn chart(rows: &[FanoutRow]) -> Result<String, String> {
    let categories: Vec<String> = rows
        .iter()
        .map(|r| format!("{} watchers", r.watchers))
        .collect();
    grouped_bars(
        "Watch fan-out: a registration's time to reach the watchers",
        "ms from the registration's start",
        &categories,
        &[
            Series::of("median watcher", rows, |r| r.median_watcher_ms),
            Series::of("last watcher", rows, |r| r.last_watcher_ms),
        ],
    )
}
