//! pd-epp, the endpoint picker: picks per second over ext_proc and the decision's latency (from
//! a request's complete body to the answer naming its endpoint), P/D and engines alone, at
//! each concurrency, with pd-epp's CPU per pick; then what Envoy with pd-epp adds over Envoy
//! alone, completions through both in front of the same instant engine.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use pd_epp_conformance::{connect, Exchange};

use super::loadgen::{self, LoadConfig, LoadReport, ProcessUsage};
use super::mocks::Mocks;
use super::proxy::{completions, launch, prompt_tokens, request_body, Settings};
use super::report::Row;
use crate::cluster::gateway::{envoy_args, envoy_config, GatewaySpec};
use crate::cluster::{free_port, spawn, wait_for, Process};

/// pd-epp in front of the mocks: P/D (`pd`) or the decode alone; once ready.
async fn start_epp(
    bin_dir: &Path,
    run_dir: &Path,
    mocks: &Mocks,
    pd: bool,
) -> Result<(Process, u16), String> {
    let (port, metrics) = (free_port(), free_port());
    let mut args = format!(
        "--host 127.0.0.1 --port {port} --admin-port {metrics} --decode http://{} --policy round_robin",
        mocks.decode
    );
    if pd {
        args.push_str(&format!(
            " --prefill http://{} {}",
            mocks.prefill,
            mocks.bootstrap.port()
        ));
    }
    let args: Vec<String> = args.split_whitespace().map(str::to_owned).collect();
    let name = if pd { "epp-pd" } else { "epp-alone" };
    let url = format!("http://127.0.0.1:{metrics}");
    let mut process =
        spawn(run_dir, name, &bin_dir.join("pd-epp"), &args, url).map_err(|e| e.to_string())?;
    wait_for(&mut process, "/ready", Duration::from_secs(60))
        .await
        .map_err(|e| e.to_string())?;
    Ok((process, port))
}

/// One pick as Envoy asks for it: a stream, the request's headers and body, the answer naming
/// the endpoint, the body back.
async fn pick(client: &mut pd_epp_conformance::Client, body: &[u8]) -> Result<Duration, String> {
    let wait = Duration::from_secs(5);
    let mut exchange = Exchange::open(client, None, wait)
        .await
        .map_err(|e| e.to_string())?;
    let fail = |e: pd_epp_conformance::ExchangeError| e.to_string();
    let started = Instant::now();
    exchange
        .request_headers("POST", "/v1/completions", false)
        .await
        .map_err(fail)?;
    exchange.request_body(body, true).await.map_err(fail)?;
    let answer = exchange.answer().await.map_err(fail)?;
    let took = started.elapsed();
    pd_epp_conformance::rules::routed(&answer)?;
    pd_epp_conformance::rules::body_back(&mut exchange).await?;
    Ok(took)
}

/// Picks at `concurrency` for `settings.duration` against the pd-epp at `port`.
async fn picks(port: u16, concurrency: usize, duration: Duration) -> Result<LoadReport, String> {
    let endpoint = format!("http://127.0.0.1:{port}");
    let stop = Arc::new(AtomicBool::new(false));
    let body = request_body(false);
    let warmup = duration / 5;
    let measure_from = Instant::now() + warmup;
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let mut client = connect(&endpoint).await.map_err(|e| e.to_string())?;
        let (stop, body) = (stop.clone(), body.clone());
        workers.push(tokio::spawn(async move {
            let mut latency = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("bounds");
            let (mut ok, mut errors) = (0, 0);
            while !stop.load(Ordering::Relaxed) {
                let result = pick(&mut client, &body).await;
                if Instant::now() < measure_from {
                    continue;
                }
                match result {
                    Ok(took) => {
                        ok += 1;
                        let _ = latency.record(took.as_micros().max(1) as u64);
                    }
                    Err(_) => errors += 1,
                }
            }
            (ok, errors, latency)
        }));
    }
    tokio::time::sleep(warmup + duration).await;
    stop.store(true, Ordering::Relaxed);
    let mut report = LoadReport {
        ok: 0,
        errors: 0,
        elapsed: duration,
        latency_us: Histogram::new_with_bounds(1, 60_000_000, 3).expect("bounds"),
    };
    for worker in workers {
        let (ok, errors, latency) = worker.await.map_err(|e| e.to_string())?;
        report.ok += ok;
        report.errors += errors;
        report.latency_us.add(&latency).map_err(|e| e.to_string())?;
    }
    Ok(report)
}

/// Picks per second and their latency, P/D and engines alone, at each concurrency.
pub async fn pick_rows(bin_dir: &Path, settings: &Settings) -> Result<Vec<Row>, String> {
    let mocks = Mocks::start(prompt_tokens()).await;
    let mut rows = Vec::new();
    for pd in [true, false] {
        let (mut epp, port) = start_epp(bin_dir, &settings.run_dir, &mocks, pd).await?;
        let pid = epp.pid().ok_or("pd-epp exited")?;
        let scenario = if pd {
            "pick P/D (ext_proc)"
        } else {
            "pick an engine (ext_proc)"
        };
        for &concurrency in &settings.concurrency {
            let before = ProcessUsage::read(pid);
            let report = picks(port, concurrency, settings.duration).await?;
            let after = ProcessUsage::read(pid);
            let row = Row::new(scenario, "pd-epp", concurrency, &report, before, after);
            eprintln!("{}", row.markdown());
            rows.push(row);
        }
        epp.stop(Duration::from_secs(1)).await;
    }
    Ok(rows)
}

/// Envoy as the bench runs it: on `listen`, asking the pd-epp at `epp` when given, else
/// routing everything to `engine` (Envoy alone).
fn envoy_yaml(listen: u16, admin: u16, epp: Option<u16>, engine: SocketAddr) -> String {
    let spec = GatewaySpec {
        envoy: Default::default(),
        fail_open: true,
        buffered: false,
        picker_timeout: Duration::from_secs(5),
        epp_args: Vec::new(),
    };
    let fallback = [engine.to_string()];
    let config = envoy_config(&spec, listen, admin, epp.unwrap_or(1), &fallback, None);
    match epp {
        Some(_) => config,
        // Envoy alone: the same listener and routes, no picker asked.
        None => drop_ext_proc(&config),
    }
}

/// `config` without its ext_proc filter.
fn drop_ext_proc(config: &str) -> String {
    let start = config
        .find("          - name: envoy.filters.http.ext_proc")
        .expect("the template has the ext_proc filter");
    let end = start
        + config[start..]
            .find("          - name: served_to_metadata")
            .expect("a filter follows ext_proc");
    format!("{}{}", &config[..start], &config[end..])
}

/// Completions through Envoy alone and through Envoy with pd-epp, in front of the same instant
/// engine, at each concurrency.
pub async fn envoy_rows(
    bin_dir: &Path,
    envoy: &Path,
    settings: &Settings,
) -> Result<Vec<Row>, String> {
    let mocks = Mocks::start(prompt_tokens()).await;
    let (mut epp, epp_port) = start_epp(bin_dir, &settings.run_dir, &mocks, false).await?;
    let mut rows = Vec::new();
    for (system, picker) in [("Envoy alone", None), ("Envoy + pd-epp", Some(epp_port))] {
        let (listen, admin) = (free_port(), free_port());
        let path = settings.run_dir.join(format!("envoy-{listen}.yaml"));
        std::fs::write(&path, envoy_yaml(listen, admin, picker, mocks.decode))
            .map_err(|e| e.to_string())?;
        let args = envoy_args(&path);
        let mut process =
            launch(&settings.run_dir, "envoy", envoy, &args, listen, "/health").await?;
        let addr: SocketAddr = format!("127.0.0.1:{listen}").parse().expect("an address");
        for &concurrency in &settings.concurrency {
            let config = LoadConfig {
                concurrency,
                duration: settings.duration,
                warmup: settings.duration / 5,
                first_byte: false,
            };
            let report = loadgen::run(addr, completions(addr, false), config).await;
            let row = Row::new(
                "completion through Envoy",
                system,
                concurrency,
                &report,
                None,
                None,
            );
            eprintln!("{}", row.markdown());
            rows.push(row);
        }
        process.stop(Duration::from_secs(1)).await;
    }
    epp.stop(Duration::from_secs(1)).await;
    Ok(rows)
}
