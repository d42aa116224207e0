//! Bootstrap-server scenarios: registration, topology queries, request ids, and behaviour at
//! scale (memory, lookup latency, restart time). Each scenario runs against a fresh
//! `bootstrap-server` process so that its CPU and memory readings are its own.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    addr: SocketAddr,
    client: BootstrapClient,
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

fn query_requests(addr: SocketAddr, ids_per_call: u64, live_ids: u64) -> RequestFactory {
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

/// Even requests move the worker of engine `bench-churn` (dp rank `dp`) to a new address, odd
/// ones are `read`'s.
fn between_writes(addr: SocketAddr, dp: u32, read: RequestFactory) -> RequestFactory {
    let host = addr.to_string();
    Arc::new(move |seq| {
        if seq % 2 == 1 {
            return read(seq);
        }
        let body = serde_json::to_vec(&json!({
            "engine_id": "bench-churn", "dp_rank": dp, "tp_rank": 0, "pp_rank": 0,
            "addr": format!("tcp://10.2.0.1:{}", 1024 + seq / 2 % 60000)
        }))
        .expect("json");
        loadgen::post_json(&host, "/register", body)
    })
}

fn topology_query(addr: SocketAddr) -> RequestFactory {
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

/// What the scale scenario found.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ScaleReport {
    /// Live request ids.
    pub live_ids: u64,
    /// Registered workers.
    pub workers: u32,
    /// Server RSS with all of it loaded.
    pub rss_mib: f64,
    /// Peak RSS while loading it.
    pub peak_rss_mib: f64,
    /// `POST /query_requests` (1 id) at this size, at the highest concurrency asked.
    pub lookup: Row,
    /// `GET /query` at this size, at the highest concurrency asked.
    pub topology: Row,
    /// Milliseconds from process start to a served `/health`, after a graceful restart.
    pub restart_ms: f64,
}

/// `GET /query` as the registry grows: for each size in `workers`, a fresh server with that many
/// workers (64 per engine), then one engine's topology (what a D asks per engine), the whole
/// topology, and one engine's topology alternating with a registration (one more engine's worker
/// moving to a new address on every call: each read follows a change, as while a prefill
/// restarts), each for the settings' duration at concurrency 16; the rows name the size, and
/// the server's RSS after registration is in each row. One engine's answer should stay flat as
/// the registry grows, also between writes; the whole topology grows with it.
pub async fn query_curve(settings: &Settings, workers: &[u32]) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    for &size in workers {
        let data_dir = settings.data_dir(&format!("curve-{size}"));
        let server =
            BenchServer::start(settings, &data_dir, &format!("bench-curve-{size}")).await?;
        server.register_workers(size).await?;
        let config = settings.config(16);
        let one_engine: RequestFactory = {
            let host = server.addr.to_string();
            Arc::new(move |_| loadgen::get(&host, "/query?engine_id=bench-engine-0"))
        };
        for (what, factory) in [
            ("GET /query?engine_id= (one engine)", one_engine.clone()),
            ("GET /query (every engine)", topology_query(server.addr)),
            (
                "POST /register and GET /query?engine_id= (one engine), alternating",
                between_writes(server.addr, size / 64 + 1, one_engine),
            ),
        ] {
            let before = server.usage();
            let report = loadgen::run(server.addr, factory, config).await;
            let scenario = format!("{what}, {size} workers");
            rows.push(Row::new(
                &scenario,
                server.system(),
                16,
                &report,
                before,
                server.usage(),
            ));
        }
        server.stop().await;
    }
    Ok(rows)
}

/// 10,000 workers and `live_ids` live request ids: memory, lookup latency, restart time.
pub async fn scale(settings: &Settings, live_ids: u64) -> Result<ScaleReport, String> {
    let data_dir = settings.data_dir(&format!("scale-{live_ids}"));
    let name = format!("bench-scale-{live_ids}");
    let server = BenchServer::start(settings, &data_dir, &name).await?;
    let workers = 10_000;
    server.register_workers(workers).await?;
    server.register_request_ids(live_ids).await?;
    let usage = server.usage().ok_or("cannot read the server's usage")?;
    let concurrency = settings.concurrency.iter().copied().max().unwrap_or(16);
    let config = settings.config(concurrency);
    let before = server.usage();
    let report = loadgen::run(
        server.addr,
        query_requests(server.addr, 1, live_ids),
        config,
    )
    .await;
    let lookup = Row::new(
        "POST /query_requests (1 id) at scale",
        "pd-bootstrap",
        concurrency,
        &report,
        before,
        server.usage(),
    );
    let before = server.usage();
    let report = loadgen::run(server.addr, topology_query(server.addr), config).await;
    let topology = Row::new(
        "GET /query (10,000 workers) at scale",
        "pd-bootstrap",
        concurrency,
        &report,
        before,
        server.usage(),
    );
    server.stop().await;

    let started = Instant::now();
    let restarted = BenchServer::start(settings, &data_dir, &format!("{name}-restart")).await?;
    let restart = started.elapsed();
    let reloaded = restarted
        .client
        .query_requests_once(&["req-0".to_owned()], 0, 64)
        .await
        .map_err(|e| e.to_string())?;
    if !matches!(
        reloaded.results.get("req-0"),
        Some(pd_protocol::vllm::RequestLocation::Ok(_))
    ) {
        return Err(format!(
            "request ids were not reloaded after the restart: {reloaded:?}"
        ));
    }
    restarted.stop().await;
    Ok(ScaleReport {
        live_ids,
        workers,
        rss_mib: usage.rss as f64 / (1024.0 * 1024.0),
        peak_rss_mib: usage.peak_rss as f64 / (1024.0 * 1024.0),
        lookup,
        topology,
        restart_ms: restart.as_secs_f64() * 1e3,
    })
}
