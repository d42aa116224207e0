use std::process::ExitCode;

use pd_epp::config::{Args, PREFILL_ENV};
use pd_epp::Epp;
use pd_service::{disable_transparent_huge_pages, drain_on_signal, init_logging};

/// mimalloc, as pd-proxy: many small allocations freed on other threads.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    disable_transparent_huge_pages();
    let args = Args::parse_args();
    let _logging = init_logging(args.log_format);
    let prefill_env = std::env::var(PREFILL_ENV).ok();
    let shutdown_delay = args.shutdown_delay;
    let config = match args.into_config(prefill_env.as_deref()) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("pd-epp: {err}");
            return ExitCode::from(2);
        }
    };
    let epp = match Epp::bind(config).await {
        Ok(epp) => epp,
        Err(err) => {
            eprintln!("pd-epp: {err}");
            return ExitCode::FAILURE;
        }
    };
    let stop = drain_on_signal(&epp.draining(), shutdown_delay);
    match epp.run(stop).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("pd-epp: {err}");
            ExitCode::FAILURE
        }
    }
}
