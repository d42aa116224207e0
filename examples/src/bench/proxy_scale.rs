//! pd-proxy's scale curves for capacity planning: requests per second, latency and CPU per
//! request as the number of clients in flight grows, and as the number of backends behind it
//! grows (half prefills, half decodes), each against instant mock engines in this process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::loadgen::{self, LoadConfig, ProcessUsage};
use super::mocks::{mock_backend, mock_bootstrap};
use super::proxy::{completions, launch};
use super::report::Row;
use crate::cluster::free_port;

/// Concurrency of the backends curve: enough to keep every pair of a small pool busy.
const BACKENDS_CONCURRENCY: usize = 64;

/// Where and how long to run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The folder holding `pd-proxy`.
    pub bin_dir: PathBuf,
    /// Scratch folder for logs.
    pub run_dir: PathBuf,
    /// Measured time per point.
    pub duration: Duration,
}

/// A pd-proxy in front of `prefills` prefills and `decodes` decodes (all instant mocks, the
/// prefills sharing one mock bootstrap server); measures whole completions at each
/// concurrency in `levels`, one row each named by `scenario`.
async fn measure_proxy(
    settings: &Settings,
    scenario: &str,
    prefills: usize,
    decodes: usize,
    levels: &[usize],
) -> Result<Vec<Row>, String> {
    let bootstrap = mock_bootstrap().await;
    let port = free_port();
    let mut args: Vec<String> = ["--host", "127.0.0.1", "--port", &port.to_string()]
        .map(str::to_owned)
        .to_vec();
    for _ in 0..prefills {
        let prefill = mock_backend(None, None).await;
        args.extend([
            "--prefill".to_owned(),
            format!("http://{prefill}"),
            bootstrap.port().to_string(),
        ]);
    }
    for _ in 0..decodes {
        let decode = mock_backend(None, None).await;
        args.extend(["--decode".to_owned(), format!("http://{decode}")]);
    }
    let program = settings.bin_dir.join("pd-proxy");
    let name = format!("pd-proxy-{prefills}p{decodes}d");
    let mut process = launch(&settings.run_dir, &name, &program, &args, port, "/ready").await?;
    let target: SocketAddr = ([127, 0, 0, 1], port).into();
    let mut rows = Vec::new();
    for &concurrency in levels {
        let config = LoadConfig {
            concurrency,
            duration: settings.duration,
            warmup: Duration::from_millis(500),
            first_byte: false,
        };
        let before = process.pid().and_then(ProcessUsage::read);
        let report = loadgen::run(target, completions(target, false), config).await;
        let after = process.pid().and_then(ProcessUsage::read);
        let row = Row::new(scenario, "pd-proxy", concurrency, &report, before, after);
        eprintln!("{}", row.markdown());
        rows.push(row);
    }
    process.stop(Duration::from_secs(5)).await;
    Ok(rows)
}

/// One prefill and one decode, at each concurrency in `levels` (1 to 1,024 in flight).
pub async fn concurrency_curve(settings: &Settings, levels: &[usize]) -> Result<Vec<Row>, String> {
    measure_proxy(settings, "completions, 1 P + 1 D", 1, 1, levels).await
}

/// `backends` backends each (2 to 256: half prefills, half decodes), at concurrency 64.
pub async fn backends_curve(settings: &Settings, backends: &[usize]) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    for &count in backends {
        let prefills = (count / 2).max(1);
        let decodes = count.saturating_sub(prefills).max(1);
        let scenario = format!("completions, {prefills} P + {decodes} D");
        let measured = measure_proxy(
            settings,
            &scenario,
            prefills,
            decodes,
            &[BACKENDS_CONCURRENCY],
        )
        .await?;
        rows.extend(measured);
    }
    Ok(rows)
}
