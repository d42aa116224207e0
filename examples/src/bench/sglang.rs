//! SGLang's bootstrap wire, pd-bootstrap beside SGLang's own server: `CommonKVBootstrapServer`
//! from the installed `sglang` package, run by `examples/bench/sglang_bootstrap.py` in the
//! virtualenv `examples/bench/sglang-peer.sh` makes. Each system runs in its own process and gets
//! the same requests at the same concurrency, a fresh server per scenario group.
//!
//! What differs and stays in the figures: pd-bootstrap makes every `PUT /route` and
//! `POST /register_dp_rank` durable before answering; SGLang's server keeps them in memory.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use super::bootstrap::{measure, BenchServer, Measured, Settings};
use super::loadgen::{self, ProcessUsage, RequestFactory};
use super::report::Row;
use crate::cluster::{free_port, spawn, wait_for, Process};

/// The harness that starts SGLang's server.
const HARNESS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/bench/sglang_bootstrap.py");

/// The complete deployment the lookups run against: dp 8 x tp 8.
const LOOKUP_DP: u64 = 8;
const LOOKUP_TP: u64 = 8;

/// SGLang's own bootstrap server, started for one scenario group.
struct SglangServer {
    process: Process,
    addr: SocketAddr,
}

impl SglangServer {
    async fn start(python: &Path, log_dir: &Path, name: &str) -> Result<Self, String> {
        let port = free_port();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let args = [HARNESS.to_owned(), "127.0.0.1".to_owned(), port.to_string()];
        let mut process = spawn(log_dir, name, python, &args, format!("http://{addr}"))
            .map_err(|e| e.to_string())?;
        wait_for(&mut process, "/health", Duration::from_secs(120))
            .await
            .map_err(|e| e.to_string())?;
        Ok(SglangServer { process, addr })
    }
}

impl Measured for SglangServer {
    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn usage(&self) -> Option<ProcessUsage> {
        ProcessUsage::read(self.process.pid()?)
    }

    fn system(&self) -> &str {
        "SGLang 0.5.23"
    }
}

/// The `seq`-th prefill rank's row of a deployment of `dp` x `tp` ranks.
fn row(seq: u64, dp: u64, tp: u64) -> Value {
    json!({
        "attn_tp_size": tp, "attn_tp_rank": seq % tp, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": dp, "system_dp_rank": seq / tp % dp,
        "rank_ip": format!("10.2.{}.{}", seq / 250 % 250, seq % 250),
        "rank_port": 20000 + seq % 40000, "page_size": 64, "kv_cache_dtype": "bfloat16",
    })
}

fn put_route(addr: SocketAddr, dp: u64, tp: u64) -> RequestFactory {
    let host = addr.to_string();
    Arc::new(move |seq| {
        let body = serde_json::to_vec(&row(seq, dp, tp)).expect("json");
        loadgen::json_request(hyper::Method::PUT, &host, "/route", body)
    })
}

fn get_rank(addr: SocketAddr) -> RequestFactory {
    let host = addr.to_string();
    Arc::new(move |seq| {
        let (dp, tp) = (seq / LOOKUP_TP % LOOKUP_DP, seq % LOOKUP_TP);
        let path = format!(
            "/route?prefill_dp_rank={dp}&prefill_cp_rank=0&target_tp_rank={tp}&target_pp_rank=0"
        );
        loadgen::get(&host, &path)
    })
}

fn get_topology(addr: SocketAddr) -> RequestFactory {
    let host = addr.to_string();
    Arc::new(move |_| {
        loadgen::get(
            &host,
            "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
        )
    })
}

fn register_room(addr: SocketAddr, first_room: u64) -> RequestFactory {
    let host = addr.to_string();
    Arc::new(move |seq| {
        let body = serde_json::to_vec(
            &json!({"bootstrap_room": first_room + seq, "dp_rank": seq % LOOKUP_DP}),
        )
        .expect("json");
        loadgen::post_json(&host, "/register_dp_rank", body)
    })
}

fn query_rooms(addr: SocketAddr, live_rooms: u64) -> RequestFactory {
    let host = addr.to_string();
    Arc::new(move |seq| {
        let rooms: Vec<u64> = (0..8)
            .map(|k| (seq * 8 + k).wrapping_mul(2_654_435_761) % live_rooms)
            .collect();
        let body = serde_json::to_vec(&json!({"bootstrap_rooms": rooms})).expect("json");
        loadgen::post_json(&host, "/query_dp_ranks", body)
    })
}

/// Sends `count` requests from `make` at concurrency 64; every one must succeed.
async fn load(server: &dyn Measured, make: RequestFactory, count: u64) -> Result<(), String> {
    let report = loadgen::run_count(server.addr(), make, count, 64).await;
    match report.errors {
        0 => Ok(()),
        errors => Err(format!(
            "{errors} of {count} set-up requests failed on {}",
            server.system()
        )),
    }
}

/// Which system the scenarios run on.
#[derive(Clone, Copy)]
enum System<'a> {
    PdBootstrap,
    /// SGLang's server, run by this virtualenv's python.
    Sglang(&'a Path),
}

/// A started server of either system.
enum Started {
    PdBootstrap(BenchServer),
    Sglang(SglangServer),
}

impl Started {
    /// A fresh server of `system` for the scenario group `group`.
    async fn start(system: System<'_>, settings: &Settings, group: &str) -> Result<Self, String> {
        Ok(match system {
            System::PdBootstrap => {
                let name = format!("bench-sglang-{group}");
                Started::PdBootstrap(
                    BenchServer::start(settings, &settings.data_dir(&name), &name).await?,
                )
            }
            System::Sglang(python) => {
                let name = format!("sglang-server-{group}");
                Started::Sglang(SglangServer::start(python, &settings.work_dir, &name).await?)
            }
        })
    }

    async fn stop(self) {
        match self {
            Started::PdBootstrap(server) => server.stop().await,
            Started::Sglang(mut server) => server.process.stop(Duration::from_secs(10)).await,
        }
    }

    fn server(&self) -> &dyn Measured {
        match self {
            Started::PdBootstrap(server) => server,
            Started::Sglang(server) => server,
        }
    }
}

/// Every scenario on one system: registration (a fresh server, one new rank per call), then on
/// a complete dp 8 x tp 8 deployment the lookups, the room writes and the room queries.
async fn scenarios(system: System<'_>, settings: &Settings) -> Result<Vec<Row>, String> {
    let mut rows = Vec::new();
    let started = Started::start(system, settings, "register").await?;
    let server = started.server();
    measure(
        server,
        settings,
        "SGLang PUT /route (new rank per call)",
        put_route(server.addr(), 65_535, 64),
        &mut rows,
    )
    .await;
    started.stop().await;

    let started = Started::start(system, settings, "lookups").await?;
    let server = started.server();
    let ranks = LOOKUP_DP * LOOKUP_TP;
    load(
        server,
        put_route(server.addr(), LOOKUP_DP, LOOKUP_TP),
        ranks,
    )
    .await?;
    for (scenario, make) in [
        (
            "SGLang GET /route (one rank of 64)",
            get_rank(server.addr()),
        ),
        ("SGLang GET /route (topology)", get_topology(server.addr())),
        (
            "SGLang POST /register_dp_rank (new room per call)",
            register_room(server.addr(), 1 << 40),
        ),
    ] {
        measure(server, settings, scenario, make, &mut rows).await;
    }
    let live_rooms = 100_000;
    load(server, register_room(server.addr(), 0), live_rooms).await?;
    measure(
        server,
        settings,
        "SGLang POST /query_dp_ranks (8 rooms of 100,000)",
        query_rooms(server.addr(), live_rooms),
        &mut rows,
    )
    .await;
    started.stop().await;
    Ok(rows)
}

/// The SGLang scenarios on pd-bootstrap and, with `sglang_venv`, on SGLang's own server, each
/// scenario's rows side by side.
pub async fn routes(settings: &Settings, sglang_venv: Option<&Path>) -> Result<Vec<Row>, String> {
    let mut rows = scenarios(System::PdBootstrap, settings).await?;
    let order: Vec<String> = rows.iter().map(|r| r.scenario.clone()).collect();
    if let Some(venv) = sglang_venv {
        let python = venv.join("bin/python");
        rows.extend(scenarios(System::Sglang(&python), settings).await?);
    }
    let position = |row: &Row| order.iter().position(|s| *s == row.scenario);
    rows.sort_by_key(|row| (position(row), row.concurrency));
    Ok(rows)
}
