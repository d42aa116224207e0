//! What a network peer can reach: the operator's routes (`/metrics`, the live page) behind the
//! write guard or on a listener of their own, HTTPS with client certificates for writers (the
//! real binary, its flags, the worker client), and TLS files that cannot be used.

mod common;

use std::ffi::OsStr;
use std::time::Duration;

use pd_service::test_certs::TestCa;
use reqwest::StatusCode;
use worker_client::protocol::vllm::RegisterWorker;
use worker_client::{BootstrapClient, ClientError, ClientTls};

use common::binary::start_binary;

/// The operator's routes and a sample of the workers' (which stay open).
const OPERATOR: [&str; 4] = ["/metrics", "/ui", "/ui/state", "/ui/style.css"];
const WORKERS: [&str; 4] = ["/workers", "/query", "/health", "/ready"];

async fn status(client: &reqwest::Client, url: String, token: Option<&str>) -> StatusCode {
    let mut request = client.get(url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    request.send().await.unwrap().status()
}

#[tokio::test]
async fn the_operators_routes_need_what_writes_need_once_writes_are_protected() {
    let open = common::start().await;
    for path in OPERATOR.iter().chain(&WORKERS) {
        let got = status(&open.client, open.url(path), None).await;
        assert_ne!(got.as_u16() / 100, 4, "{path} on an open server: {got}");
    }
    let guarded = common::start_with(|config| config.auth_token = Some("s3cret".into())).await;
    for path in OPERATOR {
        let got = status(&guarded.client, guarded.url(path), None).await;
        assert_eq!(got, StatusCode::UNAUTHORIZED, "{path}");
        let got = status(&guarded.client, guarded.url(path), Some("s3cret")).await;
        assert!(got.is_success(), "{path} with the token: {got}");
    }
    for path in WORKERS {
        let got = status(&guarded.client, guarded.url(path), None).await;
        assert_ne!(got.as_u16() / 100, 4, "{path} stays open: {got}");
    }
    let scraped = common::start_with(|config| {
        config.auth_token = Some("s3cret".into());
        config.metrics_open = true;
    })
    .await;
    let got = status(&scraped.client, scraped.url("/metrics"), None).await;
    assert_eq!(got, StatusCode::OK, "--metrics-open");
    let got = status(&scraped.client, scraped.url("/ui/state"), None).await;
    assert_eq!(got, StatusCode::UNAUTHORIZED, "the live page stays guarded");
}

#[tokio::test]
async fn an_admin_listener_takes_the_operators_routes_off_the_workers_port() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = common::config(dir.path());
    config.admin_addr = Some((std::net::Ipv4Addr::LOCALHOST, 0).into());
    let server = bootstrap_server::Server::bind(config).await.unwrap();
    let admin = server.admin_addr().expect("an admin listener");
    let handle = server.spawn();
    let client = reqwest::Client::new();
    for path in OPERATOR {
        let got = status(&client, format!("{}{path}", handle.url()), None).await;
        assert_eq!(got, StatusCode::NOT_FOUND, "{path} on the workers' port");
        let got = status(&client, format!("http://{admin}{path}"), None).await;
        assert!(got.is_success(), "{path} on the admin port: {got}");
    }
    for path in ["/health", "/ready"] {
        let got = status(&client, format!("http://{admin}{path}"), None).await;
        assert!(got.is_success(), "{path} on the admin port: {got}");
    }
    // Only the operator's routes and the probes there.
    let got = status(&client, format!("http://{admin}/workers"), None).await;
    assert_eq!(got, StatusCode::NOT_FOUND);
    handle.shutdown().await.unwrap();
}

fn worker(engine: &str) -> RegisterWorker {
    RegisterWorker {
        engine_id: engine.into(),
        addr: "tcp://127.0.0.1:41000".into(),
        ..RegisterWorker::default()
    }
}

#[tokio::test]
async fn over_https_writers_need_a_client_certificate_and_readers_only_the_ca() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "registry");
    let writers = TestCa::new(dir.path(), "writers");
    let server = ca.server("server");
    let data = dir.path().join("data");
    let flags: Vec<&OsStr> = vec![
        "--data-dir".as_ref(),
        data.as_os_str(),
        "--tls-cert".as_ref(),
        server.cert.as_os_str(),
        "--tls-key".as_ref(),
        server.key.as_os_str(),
        "--tls-client-ca".as_ref(),
        writers.ca.as_os_str(),
    ];
    let (_child, url) = start_binary(&flags).await;
    let https = url.replace("http://127.0.0.1", "https://localhost");

    let writer = writers.client("writer");
    let tls = ClientTls::load(Some(&ca.ca), Some(&writer.cert), Some(&writer.key)).unwrap();
    let certified = BootstrapClient::builder(&https).tls(tls).build().unwrap();
    certified.register_worker(&worker("e1")).await.unwrap();

    let reader_tls = ClientTls::load(Some(&ca.ca), None, None).unwrap();
    let reader = BootstrapClient::builder(&https)
        .tls(reader_tls)
        .register_deadline(Duration::from_secs(1))
        .build()
        .unwrap();
    let listed = reader.workers().await.unwrap();
    assert_eq!(listed.workers.len(), 1, "{listed:?}");
    match reader.register_worker(&worker("e2")).await {
        Err(ClientError::Rejected {
            status: 403,
            detail,
            ..
        }) => assert!(detail.contains("--tls-client-ca"), "{detail}"),
        other => panic!("a write without a client certificate: {other:?}"),
    }
    // Plain HTTP on the TLS port is told what to do.
    let plain = reqwest::get(format!("{url}/workers")).await.unwrap();
    assert_eq!(plain.status(), StatusCode::BAD_REQUEST);
    assert!(plain.text().await.unwrap().contains("https://"));
}

#[tokio::test]
async fn tls_files_that_cannot_be_used_stop_the_start_with_the_file_named() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "registry");
    let server = ca.server("server");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "-----BEGIN CERTIFICATE-----\nnot base64\n").unwrap();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_bootstrap-server"))
        .args(["--host", "127.0.0.1", "--port", "0", "--data-dir"])
        .arg(dir.path().join("data"))
        .arg("--tls-cert")
        .arg(&garbage)
        .arg("--tls-key")
        .arg(&server.key)
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("garbage.pem") && stderr.contains("not PEM certificates"),
        "{stderr}"
    );
}
