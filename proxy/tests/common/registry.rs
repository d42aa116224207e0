//! The real bootstrap server, for tests of what the proxy learns through its `/watch`.

use std::path::Path;

use bootstrap_server::server::ServerHandle;
use bootstrap_server::{Server, ServerConfig};
use pd_protocol::vllm::RegisterWorker;
use worker_client::BootstrapClient;

/// The real bootstrap server on a free port, storing in `dir`.
pub async fn real_bootstrap(dir: &Path) -> ServerHandle {
    Server::bind(ServerConfig::local(dir))
        .await
        .unwrap()
        .spawn()
}

/// Registers `engine` on dp rank `dp_rank` of the real bootstrap server at `url`.
pub async fn register_rank(url: &str, engine: &str, dp_rank: u32, replace: bool) {
    BootstrapClient::new(url)
        .unwrap()
        .register_worker(&RegisterWorker {
            engine_id: engine.into(),
            dp_rank,
            tp_rank: 0,
            pp_rank: 0,
            addr: format!("tcp://127.0.0.1:{}", 42000 + dp_rank),
            replace: Some(replace),
            ..RegisterWorker::default()
        })
        .await
        .unwrap();
}
