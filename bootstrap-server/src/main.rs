use clap::Parser;
use pd_service::{init_logging, shutdown_signal};

use bootstrap_server::config::Args;
use bootstrap_server::Server;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let _logging = init_logging(args.log_format);
    let server = match Server::bind(args.server_config()).await {
        Ok(server) => server,
        Err(err) => {
            tracing::error!("{err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match server.run(shutdown_signal()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err}");
            std::process::ExitCode::FAILURE
        }
    }
}
