//! The bootstrap server at scale, the curves a capacity planner reads: memory, lookups and
//! restart time vs live request ids, and `GET /query` vs registered workers (also between
//! writes).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;

use super::bootstrap::{query_requests, topology_query, BenchServer, Measured, Settings};
use super::chart::{grouped_bars, Series};
use super::loadgen::{self, RequestFactory};
use super::output::Output;
use super::report::Row;

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

/// Memory, lookups (at the highest concurrency asked) and restart time per number of live
/// request ids: a table and two charts.
pub async fn section(out: &mut Output, settings: &Settings, ids: &[u64]) -> Result<(), String> {
    let mut table = String::from("| live request ids | workers | RSS MiB | peak RSS MiB | lookup p50 / p99 ms | lookup req/s | GET /query p50 / p99 ms | restart to first answer |\n|---|---|---|---|---|---|---|---|\n");
    let mut reports = Vec::new();
    for &live in ids {
        let r = scale(settings, live).await?;
        let line = format!(
            "| {} | {} | {:.0} | {:.0} | {:.3} / {:.3} | {:.0} | {:.3} / {:.3} | {:.1} ms |\n",
            r.live_ids,
            r.workers,
            r.rss_mib,
            r.peak_rss_mib,
            r.lookup.p50_ms,
            r.lookup.p99_ms,
            r.lookup.rps,
            r.topology.p50_ms,
            r.topology.p99_ms,
            r.restart_ms
        );
        eprint!("{line}");
        table.push_str(&line);
        reports.push(r);
    }
    let sizes: Vec<String> = reports
        .iter()
        .map(|r| format!("{} ids", r.live_ids))
        .collect();
    let memory = grouped_bars(
        "Bootstrap server memory vs live request ids (10,000 workers)",
        "MiB",
        &sizes,
        &[
            Series::of("RSS", &reports, |r| r.rss_mib),
            Series::of("peak RSS", &reports, |r| r.peak_rss_mib),
        ],
    )?;
    let restart = grouped_bars(
        "Restart to first answer vs live request ids",
        "seconds",
        &sizes,
        &[Series::of("restart", &reports, |r| r.restart_ms / 1e3)],
    )?;
    out.section(
        "ids-scale",
        &table,
        &reports,
        vec![("ids-memory", memory), ("ids-restart", restart)],
    )
}
