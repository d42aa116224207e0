//! Shared test helpers: the real bootstrap server in-process, a fast client, a worker, a
//! capture of this thread's logs, and runs of the `worker-client` binary.
#![allow(dead_code)] // each test binary uses a different subset

use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bootstrap_server::server::ServerHandle;
use bootstrap_server::{Server, ServerConfig};
use worker_client::protocol::vllm::RegisterWorker;
use worker_client::{BootstrapClient, BootstrapClientBuilder, RetryPolicy};

/// Every wait for an event is bounded by this.
pub const WAIT: Duration = Duration::from_secs(5);

/// The real bootstrap server on `addr` (port 0: any), storing in `dir`, showing each engine
/// as soon as its ranks are whole (these tests register every rank before they look).
pub async fn start_at(addr: SocketAddr, dir: &std::path::Path) -> ServerHandle {
    let mut config = ServerConfig {
        addr,
        ..ServerConfig::local(dir)
    };
    config.registry.settle = Duration::ZERO;
    Server::bind(config).await.unwrap().spawn()
}

/// The real bootstrap server on a free port of 127.0.0.1.
pub async fn start(dir: &std::path::Path) -> ServerHandle {
    start_at("127.0.0.1:0".parse().unwrap(), dir).await
}

/// A client builder with short timeouts and fast retries.
pub fn fast_builder(url: &str) -> BootstrapClientBuilder {
    BootstrapClient::builder(url)
        .request_timeout(Duration::from_secs(2))
        .retry_policy(RetryPolicy {
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(200),
        })
        .register_deadline(Duration::from_secs(20))
        .call_deadline(Duration::from_secs(5))
}

/// A client with short timeouts and fast retries.
pub fn fast_client(url: &str) -> BootstrapClient {
    fast_builder(url).build().unwrap()
}

/// Worker `engine` dp `dp` tp `tp`, transferring on 127.0.0.1:`port`, without a lease.
pub fn worker(engine: &str, dp: u32, tp: u32, port: u16) -> RegisterWorker {
    RegisterWorker {
        engine_id: engine.into(),
        dp_rank: dp,
        tp_rank: tp,
        pp_rank: 0,
        addr: format!("tcp://127.0.0.1:{port}"),
        ..RegisterWorker::default()
    }
}

/// Serves `app` on a free port of 127.0.0.1.
pub async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A server that accepts connections and never answers.
pub async fn silent_server() -> SocketAddr {
    serve(axum::Router::new().fallback(|| async {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }))
    .await
}

/// What the current thread logged since [`capture_logs`].
#[derive(Clone, Default)]
pub struct Logs(Arc<Mutex<Vec<u8>>>);

impl Logs {
    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// Captures this thread's logs (a current-thread test runtime runs every task on it) until the
/// guard is dropped.
pub fn capture_logs() -> (Logs, tracing::subscriber::DefaultGuard) {
    let logs = Logs::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(logs.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .finish();
    (logs, tracing::subscriber::set_default(subscriber))
}

/// How a run of the `worker-client` binary ended.
pub struct Run {
    /// The exit code.
    pub code: i32,
    /// What it printed.
    pub stdout: String,
    /// What it logged and its error.
    pub stderr: String,
}

/// Runs the CLI against `url` (the server keeps serving: the child runs asynchronously).
pub async fn cli(url: &str, args: &[&str]) -> Run {
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_worker-client"))
            .arg("--url")
            .arg(url)
            .args(args)
            .env_remove("PD_BOOTSTRAP_TOKEN")
            .output(),
    )
    .await
    .expect("the CLI finishes")
    .unwrap();
    Run {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}
