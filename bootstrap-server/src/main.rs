use pd_service::traces::Traces;
use pd_service::{disable_transparent_huge_pages, drain_on_signal, init_logging};

use bootstrap_server::config::Args;
use bootstrap_server::Server;

/// mimalloc: glibc's malloc and free were about a quarter of a durable registration's
/// instructions (callgrind; sled copies a node's items on every change), mimalloc's take 16%
/// fewer in all. Without transparent huge pages (see [`disable_transparent_huge_pages`]).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    disable_transparent_huge_pages();
    let args = Args::parse_args();
    let _logging = init_logging(args.log_format);
    // Off unless OTEL_EXPORTER_OTLP_*ENDPOINT is set.
    let traces = Traces::start("bootstrap-server").await;
    let server = match Server::bind(args.server_config()).await {
        Ok(server) => server,
        Err(err) => {
            tracing::error!("{err}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let stop = drain_on_signal(&server.draining(), args.shutdown_delay);
    let code = match server.run(stop).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err}");
            std::process::ExitCode::FAILURE
        }
    };
    traces.finish().await;
    code
}
