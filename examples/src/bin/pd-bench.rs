//! `pd-bench`: the benchmark suite. Prints a Markdown report; with `--out FILE.md` writes it,
//! its rows as `FILE.json` and a chart per section as `FILE-<section>.svg`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use pd_examples::bench::bootstrap::{self, Settings};
use pd_examples::bench::bootstrap_scale;
use pd_examples::bench::fleet::{self, order_only::Fleet};
use pd_examples::bench::output::Output;
use pd_examples::bench::proxy::{self, ProxyCommand};
use pd_examples::bench::report::Row;
use pd_examples::bench::suite::Suite;
use pd_examples::bench::{
    epp, kv_index, migration, overload, proxy_scale, real_vllm, routing, security, sglang,
    tokenize, transfer, watch,
};
use pd_examples::cluster::gateway::envoy_binary;

/// Measure the bootstrap server (and, with the peers installed, the proxy against them).
#[derive(Debug, Parser)]
#[command(name = "pd-bench", version, about)]
struct Args {
    /// Measured seconds per run.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Concurrency levels (in-flight requests): bootstrap, proxy and ttft run at each level,
    /// scale's lookups at the highest; transfer pulls one transfer at a time.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    concurrency: Vec<usize>,
    /// The folder holding the release binaries (default: this program's folder).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Write the Markdown report here too, its rows as JSON beside it (`.json`) and a chart of
    /// each section as SVG (`<stem>-<section>.svg`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// A virtualenv with the peer routers (vllm-router, smg) from examples/bench/peers.sh; the
    /// proxy scenarios then measure them too.
    #[arg(long)]
    peers_venv: Option<PathBuf>,
    /// A virtualenv with SGLang from examples/bench/sglang-peer.sh; the SGLang scenarios then
    /// measure SGLang's own bootstrap server too.
    #[arg(long)]
    sglang_venv: Option<PathBuf>,
    /// `etcd://HOST:PORT`: run the bootstrap scenarios against the etcd backend (each scenario
    /// under its own cluster name) instead of the embedded store.
    #[arg(long)]
    store: Option<String>,
    /// Run every system under test (pd-proxy, the peers, bootstrap-server, the engines it
    /// starts) on the last N CPUs this program may use and the benchmark itself (load
    /// generator, mock engines) on the others, so that the systems are compared per core on the
    /// same dedicated CPUs instead of sharing them with the load.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    proxy_cpus: Option<u16>,
    /// `--proxy-cpus` with every CPU but one.
    #[arg(long, conflicts_with = "proxy_cpus")]
    pin: bool,
    #[command(subcommand)]
    suite: Suite,
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines().find_map(|l| {
                l.strip_prefix("model name")
                    .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores ({cpu}), load generator on the same machine")
}

/// Where the benchmark and the systems it starts run.
fn placement(split: Option<&pd_examples::cpus::Split>) -> String {
    match split {
        None => "every process on every CPU".to_owned(),
        Some(split) => format!(
            "pd-bench (load generator, mock engines) on CPUs {:?}, the systems it starts on CPUs {:?} (`--proxy-cpus {}`)",
            split.own,
            split.children,
            split.children.len()
        ),
    }
}

async fn proxy_rows(settings: &Settings, peers_venv: Option<&Path>) -> Result<Vec<Row>, String> {
    let mut proxies = vec![ProxyCommand::pd_proxy(&settings.bin_dir)];
    proxies.extend(peers_venv.map(ProxyCommand::peers).unwrap_or_default());
    let proxy_settings = proxy::Settings {
        run_dir: settings.work_dir.clone(),
        duration: settings.duration,
        concurrency: settings.concurrency.clone(),
    };
    proxy::throughput(&proxy_settings, &proxies).await
}

async fn ttft_section(settings: &Settings, requests: usize) -> Result<String, String> {
    let mut out = String::from(
        "| proxy mode | conc. | requests | TTFT p50 ms | TTFT p99 ms |\n|---|---|---|---|---|\n",
    );
    for row in proxy::ttft(
        &settings.bin_dir,
        &settings.work_dir,
        requests,
        &settings.concurrency,
    )
    .await?
    {
        let line = format!(
            "| {} | {} | {} | {:.1} | {:.1} |\n",
            row.mode, row.concurrency, row.requests, row.p50_ms, row.p99_ms
        );
        eprint!("{line}");
        out.push_str(&line);
    }
    Ok(out)
}

async fn run(args: &Args, settings: &Settings, machine: &str) -> Result<Output, String> {
    let mut out = Output::new(&format!("Machine: {machine}\n\n"));
    let all = matches!(args.suite, Suite::All);
    let wants = |suite: fn(&Suite) -> bool| all || suite(&args.suite);
    if wants(|s| matches!(s, Suite::Bootstrap)) {
        heading(&mut out, all, "Bootstrap server, per route");
        out.rows(
            "bootstrap",
            "Bootstrap server, per route",
            &bootstrap::routes(settings).await?,
        )?;
    }
    if wants(|s| matches!(s, Suite::Sglang)) {
        heading(&mut out, all, "SGLang's bootstrap wire");
        let rows = sglang::routes(settings, args.sglang_venv.as_deref()).await?;
        out.rows("sglang", "SGLang's bootstrap wire", &rows)?;
    }
    if wants(|s| matches!(s, Suite::Scale { .. })) {
        heading(&mut out, all, "Bootstrap server at scale (10,000 workers)");
        let (ids, workers, watchers, proxy_levels, proxy_backends) = match &args.suite {
            Suite::Scale {
                ids,
                workers,
                watchers,
                proxy_concurrency,
                proxy_backends,
            } => (
                ids.clone(),
                workers.clone(),
                watchers.clone(),
                proxy_concurrency.clone(),
                proxy_backends.clone(),
            ),
            _ => (
                vec![100_000, 1_000_000, 10_000_000],
                vec![10, 100, 1_000, 10_000, 100_000],
                vec![10, 100, 500, 2_000],
                vec![1, 4, 16, 64, 256, 1_024],
                vec![2, 8, 32, 128, 256],
            ),
        };
        bootstrap_scale::section(&mut out, settings, &ids).await?;
        out.text("\n`GET /query` as the registry grows (concurrency 16):\n\n");
        let curve = bootstrap_scale::query_curve(settings, &workers).await?;
        out.rows("query-curve", "GET /query as the registry grows", &curve)?;
        out.text("\nWatch fan-out (a registration's time to reach every watcher):\n\n");
        let fanout = watch::fanout(settings, &watchers).await?;
        let chart = watch::chart(&fanout)?;
        out.section(
            "watch-fanout",
            &watch::table(&fanout),
            &fanout,
            vec![("watch-fanout", chart)],
        )?;
        let proxy_settings = proxy_scale::Settings {
            bin_dir: settings.bin_dir.clone(),
            run_dir: settings.work_dir.clone(),
            duration: settings.duration,
        };
        out.text("\npd-proxy as clients in flight grow (1 P + 1 D, instant mocks):\n\n");
        let rows = proxy_scale::concurrency_curve(&proxy_settings, &proxy_levels).await?;
        out.rows("proxy-concurrency", "pd-proxy vs clients in flight", &rows)?;
        out.text("\npd-proxy as backends grow (half P, half D, concurrency 64):\n\n");
        let rows = proxy_scale::backends_curve(&proxy_settings, &proxy_backends).await?;
        out.rows("proxy-backends", "pd-proxy vs backends", &rows)?;
    }
    if wants(|s| matches!(s, Suite::Proxy)) {
        heading(&mut out, all, "Proxy, to instant mock backends");
        out.rows(
            "proxy",
            "Proxy, to instant mock backends",
            &proxy_rows(settings, args.peers_venv.as_deref()).await?,
        )?;
    }
    if wants(|s| matches!(s, Suite::Security)) {
        let title = "TLS and tenant limits, to instant mock backends";
        heading(&mut out, all, title);
        let security_settings = proxy::Settings {
            run_dir: settings.work_dir.clone(),
            duration: settings.duration,
            concurrency: settings.concurrency.clone(),
        };
        let peers = args.peers_venv.as_deref();
        let rows = security::rows(&security_settings, &settings.bin_dir, peers).await?;
        out.rows("security", title, &rows)?;
    }
    if wants(|s| matches!(s, Suite::Epp { .. })) {
        heading(&mut out, all, "pd-epp, the endpoint picker");
        let envoy = match &args.suite {
            Suite::Epp { envoy: Some(envoy) } => envoy.clone(),
            _ => envoy_binary().map_err(|e| e.to_string())?,
        };
        let epp_settings = proxy::Settings {
            run_dir: settings.work_dir.clone(),
            duration: settings.duration,
            concurrency: settings.concurrency.clone(),
        };
        let picks = epp::pick_rows(&settings.bin_dir, &epp_settings).await?;
        out.rows("epp-picks", "pd-epp picks over ext_proc", &picks)?;
        out.text(
            "
Completions through Envoy, with pd-epp and alone (one instant engine):

",
        );
        let through = epp::envoy_rows(&settings.bin_dir, &envoy, &epp_settings).await?;
        out.rows("epp-envoy", "Envoy with pd-epp and alone", &through)?;
    }
    if wants(|s| matches!(s, Suite::Ttft { .. })) {
        heading(
            &mut out,
            all,
            "TTFT: concurrent fan-out against sequential P then D",
        );
        let requests = match args.suite {
            Suite::Ttft { requests } => requests,
            _ => 40,
        };
        out.text(&ttft_section(settings, requests).await?);
    }
    if wants(|s| matches!(s, Suite::Routing { .. })) {
        heading(&mut out, all, "Routing on a multi-turn chat workload");
        let workload = match args.suite {
            Suite::Routing {
                sessions,
                turns,
                parallel,
                system_prompts,
            } => routing::chat::Workload {
                sessions,
                turns,
                concurrency: parallel,
                system_prompts,
            },
            _ => routing::chat::Workload::DEFAULT,
        };
        let scenario = routing::chat::scenario(workload);
        let rows = routing::compare(&settings.bin_dir, &settings.work_dir, &scenario).await?;
        out.routing(&scenario, &rows)?;
    }
    if wants(|s| matches!(s, Suite::Tenants { .. })) {
        heading(
            &mut out,
            all,
            "Routing on a multi-tenant workload, two proxies",
        );
        let (workload, only) = match &args.suite {
            Suite::Tenants {
                tenants,
                users,
                requests,
                parallel,
                cache_blocks,
                only,
            } => {
                let workload = routing::tenants::Workload {
                    tenants: *tenants,
                    users: *users,
                    requests: *requests,
                    concurrency: *parallel,
                    cache_blocks: *cache_blocks,
                    ..routing::tenants::Workload::DEFAULT
                };
                (workload, only.clone())
            }
            _ => (routing::tenants::Workload::DEFAULT, Vec::new()),
        };
        let mut scenario = routing::tenants::scenario(workload);
        if !only.is_empty() {
            scenario
                .setups
                .retain(|(name, _)| only.iter().any(|o| o == name));
        }
        let rows = routing::compare(&settings.bin_dir, &settings.work_dir, &scenario).await?;
        out.routing(&scenario, &rows)?;
    }
    if wants(|s| matches!(s, Suite::KvIndex { .. })) {
        heading(&mut out, all, "KV block index and tokenization, one thread");
        let (kv, tokenizer) = match &args.suite {
            Suite::KvIndex {
                engines,
                rounds,
                matches,
                tokenizer,
            } => {
                let kv = kv_index::Settings {
                    engines: *engines,
                    rounds: *rounds,
                    matches: *matches,
                };
                (kv, tokenizer.clone())
            }
            _ => (kv_index::Settings::DEFAULT, None),
        };
        kv_index::section(&mut out, &kv)?;
        let model = tokenizer.as_deref();
        tokenize::section(&mut out, &settings.work_dir, model)?;
    }
    if let Suite::Overload { loads } = &args.suite {
        let overload_settings = overload::Settings {
            bin_dir: settings.bin_dir.clone(),
            run_dir: settings.work_dir.clone(),
            peers_venv: args.peers_venv.clone(),
            seconds: args.seconds,
            loads: loads.clone(),
        };
        out.text(&format!(
            "Engines' capacity: {:.0} requests/s (two decodes of four at once, 32 tokens at 10 ms); \
             {} s of arrivals per run, the first second not counted. Targets: interactive TTFT \
             500 ms, standard 5 s, batch 20 s.\n\n",
            overload::capacity(),
            args.seconds
        ));
        let rows = overload::rows(&overload_settings).await?;
        out.section(
            "overload",
            &overload::table(&rows),
            &rows,
            overload::charts(&rows)?,
        )?;
    }
    if let Suite::Migration { faults, real } = args.suite {
        let rows = migration::rows(&settings.bin_dir, &settings.work_dir, faults, real).await?;
        let charts = migration::charts(&rows)?;
        out.section("migration", &migration::table(&rows), &rows, charts)?;
    }
    if let Suite::Fleet {
        traces,
        from,
        to,
        shift,
        engines,
        cache_tokens,
        eps,
        seed,
        timed,
        splits,
        engine_model,
        time_scale,
        rates,
        ttft_slo,
        tpot_slo,
        max_requests,
        systems,
        start_delay,
        scale_down_after,
    } = &args.suite
    {
        let timed = timed.then(|| fleet::timed::TimedSettings {
            bin_dir: settings.bin_dir.clone(),
            run_dir: settings.work_dir.clone(),
            peers_venv: args.peers_venv.clone(),
            preset: *engine_model,
            time_scale: *time_scale,
            splits: splits.clone(),
            rates: rates.clone(),
            ttft_slo: *ttft_slo,
            tpot_slo: *tpot_slo,
            limit: *max_requests,
            systems: systems.clone(),
            start_delay: *start_delay,
            scale_down_after: *scale_down_after,
        });
        let settings = fleet::Settings {
            traces: traces.clone(),
            from: *from,
            to: *to,
            shift: shift.clone(),
            fleet: Fleet {
                engines: *engines as usize,
                cache_tokens: *cache_tokens,
                eps: *eps,
                seed: *seed,
            },
            timed,
        };
        fleet::section(&mut out, &settings).await?;
    }
    if let Suite::RealVllm { requests } = args.suite {
        out.text(&real_vllm::section(&settings.bin_dir, &settings.work_dir, requests).await?);
    }
    if wants(|s| matches!(s, Suite::Transfer { .. })) {
        heading(&mut out, all, "KV data plane: pull bandwidth beside memcpy");
        let (mib, pulls) = match args.suite {
            Suite::Transfer { mib, pulls } => (mib, pulls),
            _ => (64, 8),
        };
        out.text(&transfer::section(&settings.bin_dir, mib, pulls).await?);
    }
    Ok(out)
}

/// A section's heading, when the run has several.
fn heading(out: &mut Output, all: bool, title: &str) {
    if all {
        out.text(&format!("\n### {title}\n\n"));
    }
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    // Read before a split narrows what this process may use.
    let mut machine = machine();
    // Every client connection and every system's connections fit: 1,024 clients in flight
    // open a few thousand sockets, over the usual soft limit of 1,024.
    if let Err(err) = pd_examples::bench::loadgen::raise_open_files_limit() {
        eprintln!("warning: cannot raise the open files limit: {err}");
    }
    if args.pin || args.proxy_cpus.is_some() {
        // Before the runtime starts, so that its threads inherit the CPUs.
        match pd_examples::cpus::split(args.proxy_cpus.map(usize::from)) {
            Ok(split) => machine = format!("{machine}; {}", placement(Some(&split))),
            Err(err) => {
                eprintln!("error: --proxy-cpus: {err}");
                return std::process::ExitCode::FAILURE;
            }
        }
    } else {
        machine = format!("{machine}; {}", placement(None));
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the runtime: {err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    runtime.block_on(measure(args, machine))
}

/// Runs the suite asked for on `machine` (what the report says of it) and prints (and writes)
/// its report.
async fn measure(args: Args, machine: String) -> std::process::ExitCode {
    let bin_dir = args.bin_dir.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(PathBuf::from))
            .unwrap_or_default()
    });
    let work = match tempfile::Builder::new().prefix("pd-bench-").tempdir() {
        Ok(dir) => dir,
        Err(err) => {
            eprintln!("error: {err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let settings = Settings {
        bin_dir,
        work_dir: work.path().to_path_buf(),
        duration: Duration::from_secs_f64(args.seconds),
        concurrency: args.concurrency.clone(),
        store: args.store.clone(),
    };
    match run(&args, &settings, &machine).await {
        Ok(report) => {
            println!("{}", report.markdown());
            if let Some(path) = &args.out {
                match report.write(path) {
                    Ok(files) => {
                        for file in files {
                            eprintln!("wrote {}", file.display());
                        }
                    }
                    Err(err) => {
                        eprintln!("error: {err}");
                        return std::process::ExitCode::FAILURE;
                    }
                }
            }
            std::process::ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("error: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}
