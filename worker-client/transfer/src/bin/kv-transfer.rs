//! `kv-transfer`: the KV data plane by hand. `export` plays a P worker that publishes numbered
//! transfers of a known byte pattern; `pull` plays a D worker that pulls and verifies them and
//! reports the bandwidth (and, with `--memcpy`, this machine's memcpy bandwidth beside it).
//! The two-process tests and `pd-bench transfer` run it.

use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use pd_service::{init_logging, parse_seconds, LogFormat};
use pd_transfer::{pattern, ExportConfig, KvExporter, KvPuller, Transport};
use serde_json::json;

/// Export or pull numbered KV transfers `<id>-0`, `<id>-1`... of a deterministic pattern.
#[derive(Debug, Parser)]
#[command(name = "kv-transfer", version, about)]
struct Args {
    #[command(subcommand)]
    role: Role,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// P: publish `count` transfers (at most `ahead` unpulled at a time), then serve until
    /// standard input closes or a signal. Prints `addr <transfer address>`, then `pulling` when
    /// a D first holds a UCX descriptor.
    Export(ExportArgs),
    /// D: pull and verify `count` transfers, one JSON line each.
    Pull(PullArgs),
}

/// Which transfers: `<id>-0` ... `<id>-<count - 1>`, each `bytes` long, transfer i filled with
/// the pattern of seed `seed + i`.
#[derive(Debug, clap::Args)]
struct Transfers {
    /// Transfer id prefix.
    #[arg(long)]
    id: String,
    /// Bytes per transfer.
    #[arg(long)]
    bytes: usize,
    /// How many transfers.
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// Pattern seed of transfer 0 (transfer i uses seed + i).
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Flags of `export`.
#[derive(Debug, clap::Args)]
struct ExportArgs {
    /// The transport.
    #[arg(long, value_enum)]
    transport: Transport,
    /// The listener's address.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    #[command(flatten)]
    transfers: Transfers,
    /// How many may be published and not yet pulled.
    #[arg(long, default_value_t = 2)]
    ahead: usize,
    /// Seconds published KV is held.
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    hold: Duration,
    /// UCX: MiB of UCX-allocated KV memory.
    #[arg(long, default_value_t = 256)]
    pool_mib: usize,
}

/// Flags of `pull`.
#[derive(Debug, clap::Args)]
struct PullArgs {
    /// The exporter's transfer address.
    #[arg(long)]
    addr: String,
    #[command(flatten)]
    transfers: Transfers,
    /// Seconds each pull may take.
    #[arg(long, default_value = "10", value_parser = parse_seconds)]
    deadline: Duration,
    /// A new puller (UCX context, worker, endpoint) for every transfer.
    #[arg(long)]
    fresh: bool,
    /// First measure memcpy of `bytes` (best of 5) and print it.
    #[arg(long)]
    memcpy: bool,
}

fn gb_per_s(bytes: usize, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9
}

/// memcpy of `bytes` between two pre-faulted buffers, best of 5, in GB/s.
fn memcpy_bandwidth(bytes: usize) -> f64 {
    let source = pattern(7, bytes);
    let mut target = vec![1u8; bytes];
    (0..5)
        .map(|_| {
            let started = Instant::now();
            target.copy_from_slice(&source);
            std::hint::black_box(&target);
            gb_per_s(bytes, started.elapsed())
        })
        .fold(0.0, f64::max)
}

async fn export(args: ExportArgs) -> Result<(), String> {
    let ExportArgs {
        transport,
        host,
        transfers:
            Transfers {
                id,
                bytes,
                count,
                seed,
            },
        ahead,
        hold,
        pool_mib,
    } = args;
    let config = ExportConfig {
        pool_bytes: pool_mib << 20,
        ..ExportConfig::new(transport, hold)
    };
    let exporter = KvExporter::start(SocketAddr::new(host, 0), config)
        .await
        .map_err(|e| e.to_string())?;
    println!("addr {}", exporter.transfer_addr());
    let (closed_tx, mut closed) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        let _ = closed_tx.send(());
    });
    let shutdown = pd_service::shutdown_signal();
    tokio::pin!(shutdown);
    let mut published = 0;
    let mut said_pulling = false;
    loop {
        while published < count && exporter.pending() < ahead {
            let kv = pattern(seed + published as u64, bytes);
            exporter
                .publish(&format!("{id}-{published}"), &kv)
                .map_err(|e| e.to_string())?;
            published += 1;
        }
        if !said_pulling && exporter.in_flight() > 0 {
            println!("pulling");
            said_pulling = true;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(1)) => {}
            _ = &mut closed => return Ok(()),
            _ = &mut shutdown => return Ok(()),
        }
    }
}

/// The D side: the UCX puller for `ucx://` addresses when built in (it refills one buffer, as a
/// D worker's KV cache would be), the generic one otherwise.
enum Puller {
    Generic(KvPuller),
    #[cfg(feature = "ucx")]
    Ucx(pd_transfer::ucx::UcxPuller),
}

impl Puller {
    fn new(addr: &str) -> Result<Self, String> {
        #[cfg(feature = "ucx")]
        if addr.starts_with("ucx://") {
            let config = pd_transfer::ucx::PullConfig::default();
            return pd_transfer::ucx::UcxPuller::new(config)
                .map(Puller::Ucx)
                .map_err(|e| e.to_string());
        }
        let _ = addr;
        Ok(Puller::Generic(KvPuller::default()))
    }

    async fn pull(
        &self,
        addr: &str,
        transfer_id: &str,
        deadline: Duration,
        buffer: Vec<u8>,
    ) -> Result<Vec<u8>, String> {
        let pulled = match self {
            Puller::Generic(puller) => puller.pull_into(addr, transfer_id, deadline, buffer).await,
            #[cfg(feature = "ucx")]
            Puller::Ucx(puller) => puller.pull(addr, transfer_id, deadline, buffer).await,
        };
        pulled.map_err(|e| e.to_string())
    }
}

async fn pull(args: PullArgs) -> Result<(), String> {
    let PullArgs {
        addr,
        transfers:
            Transfers {
                id,
                bytes,
                count,
                seed,
            },
        deadline,
        fresh,
        memcpy,
    } = args;
    if memcpy {
        println!("{}", json!({"memcpy_gb_per_s": memcpy_bandwidth(bytes)}));
    }
    let mut puller = Puller::new(&addr)?;
    // Pre-faulted, like a D worker's KV cache.
    let mut buffer = vec![0u8; bytes];
    let mut failures = 0;
    for i in 0..count {
        if fresh && i > 0 {
            drop(puller); // The old context, worker and endpoints go first.
            puller = Puller::new(&addr)?;
        }
        let started = Instant::now();
        let pulled = puller
            .pull(
                &addr,
                &format!("{id}-{i}"),
                deadline,
                std::mem::take(&mut buffer),
            )
            .await;
        let elapsed = started.elapsed();
        let line = match pulled {
            Ok(kv) if kv == pattern(seed + i as u64, bytes) => {
                buffer = kv;
                json!({"i": i, "ok": true, "seconds": elapsed.as_secs_f64(),
                       "gb_per_s": gb_per_s(bytes, elapsed)})
            }
            Ok(kv) => {
                failures += 1;
                json!({"i": i, "ok": false, "seconds": elapsed.as_secs_f64(),
                       "error": format!("{} bytes that do not match the pattern", kv.len())})
            }
            Err(error) => {
                failures += 1;
                json!({"i": i, "ok": false, "seconds": elapsed.as_secs_f64(), "error": error})
            }
        };
        println!("{line}");
    }
    match failures {
        0 => Ok(()),
        n => Err(format!("{n} of {count} pulls failed")),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let _logging = init_logging(LogFormat::Text);
    let outcome = match args.role {
        Role::Export(args) => export(args).await,
        Role::Pull(args) => pull(args).await,
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}
