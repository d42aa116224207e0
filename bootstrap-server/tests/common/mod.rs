//! Shared helpers: a real server on 127.0.0.1:0 with a temporary database (or its own prefix in
//! a real etcd), and a JSON client.
#![allow(dead_code)] // each test binary uses a different subset

pub mod binary;
pub mod etcd;

use std::future::Future;
use std::time::Duration;

use bootstrap_server::server::ServerHandle;
use bootstrap_server::store::EtcdConfig;
use bootstrap_server::{Server, ServerConfig};
use reqwest::{Method, StatusCode};
use serde_json::Value;

/// Which store the servers of a test use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The embedded sled database.
    Sled,
    /// The test binary's shared etcd, under a cluster name of the test's own.
    Etcd,
}

tokio::task_local! {
    static BACKEND: Backend;
}

/// Runs a test with every server it starts on `backend`.
pub async fn on<F: Future>(backend: Backend, test: F) -> F::Output {
    BACKEND.scope(backend, test).await
}

/// The backend of the running test (sled unless run through [`on`]).
pub fn backend() -> Backend {
    BACKEND.try_with(|b| *b).unwrap_or(Backend::Sled)
}

/// Runs each named test (an `async fn` without arguments) once on sled and once on etcd.
#[macro_export]
macro_rules! on_both_backends {
    ($flavor:tt; $($test:ident),+ $(,)?) => {
        mod sled {
            $(
                #[tokio::test(flavor = $flavor)]
                async fn $test() {
                    $crate::common::on($crate::common::Backend::Sled, super::$test()).await
                }
            )+
        }
        mod etcd {
            $(
                #[tokio::test(flavor = $flavor)]
                async fn $test() {
                    $crate::common::on($crate::common::Backend::Etcd, super::$test()).await
                }
            )+
        }
    };
}

/// Settings for a server on the shared etcd under `cluster`.
pub fn etcd_config(endpoint: &str, cluster: &str) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![endpoint.to_owned()],
        cluster: cluster.to_owned(),
        op_timeout: Duration::from_secs(2),
    }
}

/// A running server and the folder its database lives in.
pub struct TestServer {
    pub handle: ServerHandle,
    pub dir: tempfile::TempDir,
    pub client: reqwest::Client,
    /// What it was started with.
    pub config: ServerConfig,
}

/// A server on `dir` that shows each engine as soon as its ranks form a whole grid (no settle
/// window: these tests register every rank before they look; `publication.rs` tests the window).
pub fn config(dir: &std::path::Path) -> ServerConfig {
    let mut config = ServerConfig::local(dir);
    config.registry.settle = Duration::ZERO;
    config
}

pub async fn start_with(edit: impl FnOnce(&mut ServerConfig)) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    if backend() == Backend::Etcd {
        let endpoint = etcd::shared();
        config.etcd = Some(etcd_config(endpoint, &etcd::unique_cluster()));
    }
    edit(&mut config);
    let handle = Server::bind(config.clone()).await.unwrap().spawn();
    TestServer {
        handle,
        dir,
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap(),
        config,
    }
}

pub async fn start() -> TestServer {
    start_with(|_| {}).await
}

impl TestServer {
    /// Another server on the same store: the same data folder after this one has shut down
    /// (sled), or a second replica of the same cluster (etcd).
    pub async fn successor(self) -> TestServer {
        let TestServer {
            handle,
            dir,
            client,
            config,
        } = self;
        if config.etcd.is_none() {
            handle.shutdown().await.unwrap();
        }
        let handle = Server::bind(config.clone()).await.unwrap().spawn();
        TestServer {
            handle,
            dir,
            client,
            config,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.handle.url())
    }

    /// Sends `body` (JSON, or raw text when it is a string starting with `RAW:`) and returns the
    /// status and the JSON answer (every answer must be JSON).
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        self.call_with(method, path, body, None).await
    }

    pub async fn call_with(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        token: Option<&str>,
    ) -> (StatusCode, Value) {
        let mut request = self.client.request(method, self.url(path));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        match body {
            Some(Value::String(raw)) if raw.starts_with("RAW:") => {
                request = request.body(raw[4..].to_owned())
            }
            Some(json) => request = request.json(&json),
            None => {}
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        let text = response.text().await.unwrap();
        let json = serde_json::from_str(&text)
            .unwrap_or_else(|_| panic!("answer to {path} is not JSON: {status} {text:?}"));
        (status, json)
    }

    pub async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.call(Method::POST, path, Some(body)).await
    }

    pub async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(Method::GET, path, None).await
    }

    pub async fn register(
        &self,
        engine: &str,
        dp: u32,
        tp: u32,
        pp: u32,
        addr: &str,
    ) -> (StatusCode, Value) {
        self.post(
            "/register",
            serde_json::json!({"engine_id": engine, "dp_rank": dp, "tp_rank": tp, "pp_rank": pp, "addr": addr}),
        )
        .await
    }

    /// `DELETE /register` with `selection` (an engine id and optional ranks).
    pub async fn deregister(&self, selection: Value) -> (StatusCode, Value) {
        self.call(Method::DELETE, "/register", Some(selection))
            .await
    }

    pub async fn metrics(&self) -> String {
        self.client
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}
