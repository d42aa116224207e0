use clap::Parser;
use pd_examples::sim::{SimArgs, SimEngine};
use pd_service::{init_logging, shutdown_signal};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = SimArgs::parse();
    let _logging = init_logging(args.log_format);
    let engine = match SimEngine::start(args).await {
        Ok(engine) => engine,
        Err(err) => {
            tracing::error!("{err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match engine.run(shutdown_signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("server failed: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}
