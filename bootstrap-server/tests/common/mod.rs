//! Shared helpers: a real server on 127.0.0.1:0 with a temporary database, and a JSON client.
#![allow(dead_code)] // each test binary uses a different subset

use std::time::Duration;

use bootstrap_server::registry::RegistryConfig;
use bootstrap_server::server::ServerHandle;
use bootstrap_server::{Server, ServerConfig};
use reqwest::{Method, StatusCode};
use serde_json::Value;

/// A running server and the folder its database lives in.
pub struct TestServer {
    pub handle: ServerHandle,
    pub dir: tempfile::TempDir,
    pub client: reqwest::Client,
}

pub fn config(dir: &std::path::Path) -> ServerConfig {
    ServerConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.to_path_buf(),
        etcd: None,
        auth_token: None,
        registry: RegistryConfig::default(),
    }
}

pub async fn start_with(edit: impl FnOnce(&mut ServerConfig)) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config(dir.path());
    edit(&mut config);
    let handle = Server::bind(config).await.unwrap().spawn();
    TestServer {
        handle,
        dir,
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap(),
    }
}

pub async fn start() -> TestServer {
    start_with(|_| {}).await
}

impl TestServer {
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
