//! Bootstrap-server scenarios: registration, topology queries, request ids, and behaviour at
//! scale (memory, lookup latency, restart time). Each scenario runs against a fresh
//! `bootstrap-server` process so that its CPU and memory readings are its own.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use pd_protocol::vllm::RegisterWorker;
use serde_json::json;
use worker_client::BootstrapClient;

use super::loadgen::{self, LoadConfig, ProcessUsage, RequestFactory};
use super::report::Row;
use crate::cluster::{free_port, spawn, wait_for, Process};

/// A server under test: where it listens, what it has used so far, how the report names it.
pub trait Measured {
    /// Its address.
    fn addr(&self) -> SocketAddr;
    /// Its CPU and memory so far.
    fn usage(&self) -> Option<ProcessUsage>;
    /// Its name in the report.
    fn system(&self) -> &str;
}

/// A bootstrap server started for one scenario.
pub struct BenchServer {
    process: Process,
    pub(super) addr: SocketAddr,
    pub(super) client: BootstrapClient,
    subject: &'static str,
}

impl Measured for BenchServer {
    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn usage(&self) -> Option<ProcessUsage> {
        ProcessUsage::read(self.process.pid()?)
    }

    fn system(&self) -> &str {
        self.subject
    }
}

impl BenchServer {
    /// Starts `bootstrap-server` from the settings' binary folder with its database in
    /// `data_dir`, or, with the settings' etcd store, under a cluster name made from it (so a
    /// restart with the same folder finds the same registry).
    pub async fn start(settings: &Settings, data_dir: &Path, name: &str) -> Result<Self, String> {
        let bin_dir = &settings.bin_dir;
        let port = free_port();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let mut args = vec![
            "--host".to_owned(),
            "127.0.0.1".to_owned(),
            "--port".to_owned(),
            port.to_string(),
            "--data-dir".to_owned(),
            data_dir.display().to_string(),
            // Room for the scale curve's largest size (10,000,000 live ids).
            "--max-requests".to_owned(),
            "20000000".to_owned(),
        ];
        if let Some(store) = &settings.store {
            let folder = data_dir.file_name().unwrap_or_default().to_string_lossy();
            args.extend([
                "--store".to_owned(),
                store.clone(),
                "--cluster".to_owned(),
                format!("bench-{}-{folder}", std::process::id()),
            ]);
        }
        let log_dir = data_dir.parent().unwrap_or(data_dir);
        let mut process = spawn(
            log_dir,
            name,
            &bin_dir.join("bootstrap-server"),
            &args,
            format!("http://{addr}"),
        )
        .map_err(|e| e.to_string())?;
        wait_for(&mut process, "/health", Duration::from_secs(600))
            .await
            .map_err(|e| e.to_string())?;
        let client = BootstrapClient::builder(process.url.clone())
            .request_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| e.to_string())?;
        Ok(BenchServer {
            process,
            addr,
            client,
            subject: settings.subject(),
        })
    }

    /// Registers `workers` workers: 64 tp ranks per dp rank, one engine per dp rank.
    pub async fn register_workers(&self, workers: u32) -> Result<(), String> {
        for chunk_start in (0..workers).step_by(64) {
            let chunk = (chunk_start..(chunk_start + 64).min(workers)).map(|i| {
                let worker = RegisterWorker {
                    engine_id: format!("bench-engine-{}", i / 64),
                    dp_rank: i / 64,
                    tp_rank: i % 64,
                    pp_rank: 0,
                    addr: format!(
                        "tcp://10.0.{}.{}:{}",
                        i / 250 % 250,
                        i % 250,
                        20000 + i % 40000
                    ),
                    lease_ttl: None,
                    ..RegisterWorker::default()
                };
                let client = self.client.clone();
                async move { client.register_worker(&worker).await }
            });
            for result in join_all(chunk).await {
                result.map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    }

    /// Registers request ids `req-0 .. req-{count}` on dp rank 0, `parallel` at a time.
    pub async fn register_request_ids(&self, count: u64) -> Result<(), String> {
        let report =
            loadgen::run_count(self.addr, request_registration(self.addr, "req"), count, 64).await;
        if report.errors > 0 {
            return Err(format!("{} request-id registrations failed", report.errors));
        }
        Ok(())
    }

    /// Stops the server gracefully.
    pub async fn stop(mut self) {
        self.process.stop(Duration::from_secs(30)).await;
    }
}

fn request_registration(addr: SocketAddr, prefix: &'static str) -> RequestFactory {
    let host = addr.to_string();
    Arc::new(move |seq| {
        let body = serde_json::to_vec(&json!({"req_id": format!("{prefix}-{seq}"), "dp_rank": 0}))
            .expect("json");
        loadgen::post_json(&host, "/register_request", body)
    })
}

/// `POST /query_requests` of `ids_per_call` of `live_ids` live ids.
pub(super) fn query_requests(addr: SocketAddr, ids_per_call: u64, live_ids: u64) -> RequestFactory {
    let host = addr.to_string();
    Arc::new(move |seq| {
        let ids: Vec<String> = (0..ids_per_call)
            .map(|k| {
                format!(
                    "req-{}",
                    (seq * ids_per_call + k).wrapping_mul(2_654_435_761) % live_ids
                )
            })
            .collect();
        let body = serde_json::to_vec(&json!({"req_ids": ids, "tp_rank": 0, "tp_size": 64}))
            .expect("json");
        loadgen::post_json(&host, "/query_requests", body)
    })
}

fn registration(addr: SocketAddr) -> RequestFactory {
    let host = addr.to_string();
    Arc::new(move |seq| {
        let body = serde_json::to_vec(&json!({
            "engine_id": format!("reg-engine-{}", seq / 1024), "dp_rank": seq / 1024, "tp_rank": seq % 1024,
            "pp_rank": 0, "addr": format!("tcp://10.1.0.1:{}", 1024 + seq % 60000)
        }))
        .expect("json");
        loadgen::post_json(&host, "/register", body)
    })
}

/// `GET /query`: the whole topology.
pub(super) fn topology_query(addr: SocketAddr) -> RequestFactory {
    let host = addr.to_string();
    Arc::new(move |_| loadgen::get(&host, "/query"))
}

/// Where and how long to run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Folder holding the release binaries.
    pub bin_dir: PathBuf,
    /// Scratch folder for databases and logs.
    pub work_dir: PathBuf,
    /// Measured seconds per run.
    pub duration: Duration,
    /// Concurrency levels.
    pub concurrency: Vec<usize>,
    /// `etcd://HOST:PORT`: measure the bootstrap server on etcd instead of its embedded store.
    pub store: Option<String>,
}

impl Settings {
    /// A run at `concurrency` for the settings' duration.
    pub fn config(&self, concurrency: usize) -> LoadConfig {
        LoadConfig {
            concurrency,
            duration: self.duration,
            warmup: Duration::from_millis(500),
            first_byte: false,
        }
    }

    /// The scratch folder of the server named `name`.
    pub fn data_dir(&self, name: &str) -> PathBuf {
        self.work_dir.join(format!("{name}-data"))
    }

    /// How the measured server is named in the report.
    fn subject(&self) -> &'static str {
        if self.store.is_some() {
            "pd-bootstrap (etcd)"
        } else {
            "pd-bootstrap"
        }
    }
}

/// Runs `scenario` against `server` at every concurrency of the settings, one row each.
pub async fn measure(
    server: &dyn Measured,
    settings: &Settings,
    scenario: &str,
    make: RequestFactory,
    rows: &mut Vec<Row>,
) {
    for &concurrency in &settings.concurrency {
        let before = server.usage();
        let report = loadgen::run(server.addr(), make.clone(), settings.config(concurrency)).await;
        let row = Row::new(
            scenario,
            server.system(),
            concurrency,
            &report,
            before,
            server.usage(),
        );
        eprintln!("{}", row.markdown());
        rows.push(row);
    }
}

/// The per-route scenarios, each at every concurrency level.
pub async fn routes(settings: &Settings) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();

    let server =
        BenchServer::start(settings, &settings.data_dir("register"), "bench-register").await?;
    measure(
        &server,
        settings,
        "POST /register (durable, new slot per call)",
        registration(server.addr),
        &mut rows,
    )
    .await;
    server.stop().await;

    for workers in [64, 4096] {
        let name = format!("bench-query-{workers}");
        let server = BenchServer::start(settings, &settings.data_dir(&name), &name).await?;
        server.register_workers(workers).await?;
        let scenario = format!("GET /query ({workers} workers)");
        measure(
            &server,
            settings,
            &scenario,
            topology_query(server.addr),
            &mut rows,
        )
        .await;
        server.stop().await;
    }

    let server =
        BenchServer::start(settings, &settings.data_dir("requests"), "bench-requests").await?;
    server.register_workers(64).await?;
    measure(
        &server,
        settings,
        "POST /register_request (unique ids)",
        request_registration(server.addr, "fresh"),
        &mut rows,
    )
    .await;
    let live = 100_000;
    server.register_request_ids(live).await?;
    for ids in [1, 32] {
        let scenario = format!(
            "POST /query_requests ({ids} id{})",
            if ids == 1 { "" } else { "s" }
        );
        measure(
            &server,
            settings,
            &scenario,
            query_requests(server.addr, ids, live),
            &mut rows,
        )
        .await;
    }
    server.stop().await;
    Ok(rows)
}
