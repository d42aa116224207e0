//! The real bootstrap server, for tests of what the proxy learns through its `/watch`.

use std::path::Path;

use bootstrap_server::server::ServerHandle;
use bootstrap_server::{Server, ServerConfig};
use pd_protocol::vllm::RegisterWorker;
use worker_client::BootstrapClient;

/// The real bootstrap server on a free port, storing in `dir`, showing each engine as soon as
/// its ranks are whole (no settle window: these tests time discovery, not the registry's
/// evidence; `examples/tests/half_registered.rs` runs the window end to end).
pub async fn real_bootstrap(dir: &Path) -> ServerHandle {
    let mut config = ServerConfig::local(dir);
    config.registry.settle = std::time::Duration::ZERO;
    Server::bind(config).await.unwrap().spawn()
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
