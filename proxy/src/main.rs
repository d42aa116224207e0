use std::process::ExitCode;

use pd_proxy::config::{check_config, Args, CHECK_CONFIG, PREFILL_ENV};
use pd_proxy::Proxy;
use pd_service::traces::Traces;
use pd_service::{disable_transparent_huge_pages, drain_on_signal, init_logging};

/// mimalloc: glibc's malloc and free were a tenth of the proxy's CPU (every request's headers,
/// bodies and futures, often freed on another worker thread than the one that allocated them).
/// Without transparent huge pages (see [`disable_transparent_huge_pages`]).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The control plane's runtime (discovery, health checks, KV events, reloads, the operator's
/// listener): clients are served on threads of their own (`--serving-threads`).
#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    disable_transparent_huge_pages();
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|word| word == CHECK_CONFIG) {
        let prefill_env = std::env::var(PREFILL_ENV).ok();
        return match check_config(&argv, prefill_env.as_deref()) {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(err) => {
                eprintln!("pd-proxy: {err}");
                ExitCode::from(2)
            }
        };
    }
    let args = Args::parse_args();
    let _logging = init_logging(args.log_format);
    // Off unless OTEL_EXPORTER_OTLP_*ENDPOINT is set.
    let traces = Traces::start("pd-proxy").await;
    let prefill_env = std::env::var(PREFILL_ENV).ok();
    let shutdown_delay = args.shutdown_delay;
    let config = match args.into_config(prefill_env.as_deref()) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("pd-proxy: {err}");
            return ExitCode::from(2);
        }
    };
    let proxy = match Proxy::bind(config).await {
        Ok(proxy) => proxy,
        Err(err) => {
            eprintln!("pd-proxy: {err}");
            return ExitCode::FAILURE;
        }
    };
    let stop = drain_on_signal(&proxy.draining(), shutdown_delay);
    let code = match proxy.run(stop).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("pd-proxy: {err}");
            ExitCode::FAILURE
        }
    };
    traces.finish().await;
    code
}
