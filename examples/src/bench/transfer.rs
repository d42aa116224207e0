//! KV pull bandwidth: `kv-transfer export` (P) and `kv-transfer pull` (D) as two processes on
//! this machine, over UCX with shared memory and with TCP, and over the plain TCP transport,
//! beside the memcpy bandwidth D measures in the same run and the floor of any TCP transport:
//! the same bytes copied through a plain loopback socket.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// One measured transport.
#[derive(Debug, Clone)]
pub struct TransferRow {
    /// `ucx` or `tcp` (the transfer address's scheme).
    pub transport: &'static str,
    /// `UCX_TLS` (empty for the TCP transport).
    pub ucx_tls: &'static str,
    /// Bytes per pull.
    pub bytes: usize,
    /// Pulls measured (after one warm-up pull that connects).
    pub pulls: usize,
    /// Median and best pull bandwidth, GB/s.
    pub median_gb_s: f64,
    /// Best pull.
    pub best_gb_s: f64,
    /// memcpy of the same size in D's process, GB/s (best of 5).
    pub memcpy_gb_s: f64,
    /// The same bytes through a plain loopback TCP socket (same run).
    pub socket: SocketFloor,
}

/// What a plain loopback TCP socket moves on this machine, measured like the pulls: the median
/// and the best of several rounds, so that each statistic of a pull is compared with the same
/// one of the socket.
#[derive(Debug, Clone, Copy, Default)]
pub struct SocketFloor {
    /// Median round, GB/s.
    pub median_gb_s: f64,
    /// Best round, GB/s.
    pub best_gb_s: f64,
}

/// The transports measured: (scheme, UCX_TLS).
const CASES: [(&str, &str); 3] = [("ucx", "posix,sysv,self"), ("ucx", "tcp"), ("tcp", "")];

/// Runs one export/pull pair: `pulls + 1` pulls of `bytes`, the first one a warm-up.
async fn measure(
    kv_transfer: &Path,
    transport: &'static str,
    ucx_tls: &'static str,
    bytes: usize,
    pulls: usize,
) -> Result<TransferRow, String> {
    let count = (pulls + 1).to_string();
    let size = bytes.to_string();
    let pool_mib = (3 * bytes).div_ceil(1 << 20).to_string();
    let mut exporter = Command::new(kv_transfer)
        .args([
            "export",
            "--transport",
            transport,
            "--id",
            "bench",
            "--bytes",
            &size,
        ])
        .args(["--count", &count, "--ahead", "2", "--pool-mib", &pool_mib])
        .env("UCX_TLS", ucx_tls)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", kv_transfer.display()))?;
    let stdout = exporter.stdout.take().ok_or("no exporter stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let first = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .map_err(|_| "the exporter did not start within 30 s".to_owned())?
        .map_err(|e| e.to_string())?
        .unwrap_or_default();
    let addr = first
        .strip_prefix("addr ")
        .ok_or_else(|| {
            format!("the exporter failed ({transport}): {first:?}; built with --all-features?")
        })?
        .to_owned();
    let pulled = Command::new(kv_transfer)
        .args(["pull", "--addr", &addr, "--id", "bench", "--bytes", &size])
        .args(["--count", &count, "--memcpy", "--deadline", "60"])
        .env("UCX_TLS", ucx_tls)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(300), pulled)
        .await
        .map_err(|_| "the pulls did not finish within 300 s".to_owned())?
        .map_err(|e| e.to_string())?;
    let reports: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    if !output.status.success() {
        return Err(format!(
            "pulls over {transport} (UCX_TLS={ucx_tls}) failed: {reports:?} {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let memcpy_gb_s = reports
        .iter()
        .find_map(|r| r["memcpy_gb_per_s"].as_f64())
        .ok_or("no memcpy report")?;
    let mut rates: Vec<f64> = reports
        .iter()
        .filter_map(|r| r["gb_per_s"].as_f64())
        .skip(1)
        .collect();
    rates.sort_by(f64::total_cmp);
    let median_gb_s = *rates.get(rates.len() / 2).ok_or("no pulls measured")?;
    Ok(TransferRow {
        transport,
        ucx_tls,
        bytes,
        pulls: rates.len(),
        median_gb_s,
        best_gb_s: rates.last().copied().unwrap_or_default(),
        memcpy_gb_s,
        socket: SocketFloor::default(),
    })
}

/// Rounds of the socket floor (as many as the pulls measured, plus one).
const SOCKET_ROUNDS: usize = 9;

/// `bytes` written through a loopback TCP socket by one thread and read into a reused buffer by
/// another, [`SOCKET_ROUNDS`] times: what any TCP transport on this machine can at most reach.
pub fn loopback_socket(bytes: usize) -> Result<SocketFloor, String> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let data = vec![7u8; bytes];
        let mut stream = std::net::TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        for _ in 0..SOCKET_ROUNDS {
            stream.write_all(&data)?;
        }
        Ok(())
    });
    let (mut stream, _) = listener.accept().map_err(|e| e.to_string())?;
    let mut buffer = vec![0u8; bytes];
    let mut rates = Vec::with_capacity(SOCKET_ROUNDS);
    for _ in 0..SOCKET_ROUNDS {
        let started = std::time::Instant::now();
        stream.read_exact(&mut buffer).map_err(|e| e.to_string())?;
        rates.push(bytes as f64 / started.elapsed().as_secs_f64() / 1e9);
    }
    writer
        .join()
        .map_err(|_| "the socket writer panicked".to_owned())?
        .map_err(|e| e.to_string())?;
    rates.sort_by(f64::total_cmp);
    Ok(SocketFloor {
        median_gb_s: rates[SOCKET_ROUNDS / 2],
        best_gb_s: rates[SOCKET_ROUNDS - 1],
    })
}

/// Measures every transport with `kv-transfer` from `bin_dir`.
pub async fn bandwidth(
    bin_dir: &Path,
    bytes: usize,
    pulls: usize,
) -> Result<Vec<TransferRow>, String> {
    let kv_transfer = bin_dir.join("kv-transfer");
    if !kv_transfer.is_file() {
        return Err(format!(
            "{} not found: cargo build --release --bins --all-features",
            kv_transfer.display()
        ));
    }
    let socket = tokio::task::spawn_blocking(move || loopback_socket(bytes))
        .await
        .map_err(|e| e.to_string())??;
    let mut rows = Vec::new();
    for (transport, ucx_tls) in CASES {
        let row = measure(&kv_transfer, transport, ucx_tls, bytes, pulls.max(1)).await?;
        rows.push(TransferRow { socket, ..row });
    }
    Ok(rows)
}

/// The rows as a Markdown table.
pub fn table(rows: &[TransferRow]) -> String {
    let mut out = String::from("| transport | UCX_TLS | MiB per pull | pulls | pull GB/s (median) | best | memcpy GB/s (same run) | median / memcpy | loopback socket GB/s, median / best (same run) | pull / socket, median / best |\n|---|---|---|---|---|---|---|---|---|---|\n");
    let share = |part: f64, whole: f64| 100.0 * part / whole.max(f64::MIN_POSITIVE);
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.0}% | {:.2} / {:.2} | {:.0}% / {:.0}% |\n",
            r.transport,
            if r.ucx_tls.is_empty() { "-" } else { r.ucx_tls },
            r.bytes >> 20,
            r.pulls,
            r.median_gb_s,
            r.best_gb_s,
            r.memcpy_gb_s,
            share(r.median_gb_s, r.memcpy_gb_s),
            r.socket.median_gb_s,
            r.socket.best_gb_s,
            share(r.median_gb_s, r.socket.median_gb_s),
            share(r.best_gb_s, r.socket.best_gb_s),
        ));
    }
    out
}

/// The bandwidth of `pulls` pulls of `mib` MiB per transport, as a Markdown table.
pub async fn section(bin_dir: &Path, mib: usize, pulls: usize) -> Result<String, String> {
    let rows = bandwidth(bin_dir, mib << 20, pulls).await?;
    let out = table(&rows);
    eprint!("{out}");
    Ok(out)
}
