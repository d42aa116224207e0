//! TLS on a listener served by `pd_service::serve`: certificates made by a test CA, HTTP/2 and
//! HTTP/1.1 by ALPN, plain HTTP answered with a 400, a rotated certificate picked up without
//! dropping open connections, client certificates verified, unusable files named at start.

use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::routing::get;
use axum::Router;
use pd_service::test_certs::{Issued, TestCa};
use pd_service::{serve, ClientCertified, ServeLimits, ServerTls, TlsFiles};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Answers whether the request's connection presented a verified client certificate.
fn app() -> Router {
    Router::new().route(
        "/who",
        get(|request: Request| async move {
            match request.extensions().get::<ClientCertified>() {
                Some(_) => "certified",
                None => "anonymous",
            }
        }),
    )
}

/// Serves [`app`] over TLS with `files`; returns the port.
async fn start(files: &TlsFiles) -> u16 {
    start_with(files, Duration::from_secs(30)).await
}

/// [`start`], silent connections closed after `header_read_timeout`.
async fn start_with(files: &TlsFiles, header_read_timeout: Duration) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let limits = ServeLimits {
        header_read_timeout,
        tls: Some(ServerTls::load(files).expect("usable TLS files")),
        wire_error_body: Some(|code, reason| {
            format!("{{\"code\":{code},\"error\":\"{reason}\"}}").into_bytes()
        }),
        ..ServeLimits::default()
    };
    tokio::spawn(serve(listener, app(), std::future::pending(), limits));
    port
}

fn files(server: &Issued, client_ca: Option<&TestCa>) -> TlsFiles {
    TlsFiles {
        cert: server.cert.clone(),
        key: server.key.clone(),
        client_ca: client_ca.map(|ca| ca.ca.clone()),
    }
}

/// A client trusting only `ca`, presenting `identity` when given.
fn client(ca: &TestCa, identity: Option<&Issued>) -> reqwest::ClientBuilder {
    let pem = std::fs::read(&ca.ca).unwrap();
    let mut builder = reqwest::Client::builder()
        .no_proxy()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).unwrap())
        .timeout(Duration::from_secs(5));
    if let Some(identity) = identity {
        let mut pem = std::fs::read(&identity.cert).unwrap();
        pem.extend(std::fs::read(&identity.key).unwrap());
        builder = builder.identity(reqwest::Identity::from_pem(&pem).unwrap());
    }
    builder
}

#[tokio::test]
async fn https_by_alpn_and_plain_http_is_told_to_use_https() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "test");
    let port = start(&files(&ca.server("server"), None)).await;
    let url = format!("https://localhost:{port}/who");

    let h2 = client(&ca, None)
        .build()
        .unwrap()
        .get(&url)
        .send()
        .await
        .unwrap();
    assert_eq!(h2.version(), reqwest::Version::HTTP_2);
    assert_eq!(h2.text().await.unwrap(), "anonymous");
    let h1 = (client(&ca, None).http1_only().build().unwrap())
        .get(&url)
        .send()
        .await
        .unwrap();
    assert_eq!(h1.version(), reqwest::Version::HTTP_11);
    assert_eq!(h1.text().await.unwrap(), "anonymous");

    // A client that does not trust the CA is refused at the handshake.
    let stranger = TestCa::new(dir.path(), "stranger");
    let refused = client(&stranger, None)
        .build()
        .unwrap()
        .get(&url)
        .send()
        .await;
    assert!(refused.is_err(), "{refused:?}");

    // Plain HTTP gets an answer saying what to do, not a reset.
    let mut plain = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    plain
        .write_all(b"GET /who HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), plain.read_to_string(&mut answer))
        .await
        .unwrap()
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(
        answer.contains("application/json") && answer.contains("use https://"),
        "{answer}"
    );
}

#[tokio::test]
async fn a_rotated_certificate_is_picked_up_and_open_connections_stay() {
    let dir = tempfile::tempdir().unwrap();
    let old_ca = TestCa::new(dir.path(), "old");
    let port = start(&files(&old_ca.server("server"), None)).await;
    let url = format!("https://localhost:{port}/who");
    let old_client = client(&old_ca, None).build().unwrap();
    assert!(old_client
        .get(&url)
        .send()
        .await
        .unwrap()
        .status()
        .is_success());

    // Rotated in place: a new CA's certificate in the same files.
    let new_ca = TestCa::new(dir.path(), "new");
    new_ca.server("server");
    let started = Instant::now();
    loop {
        let fresh = client(&new_ca, None).build().unwrap();
        if fresh.get(&url).send().await.is_ok() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the new certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The connection opened before the rotation still answers.
    let kept = old_client.get(&url).send().await.unwrap();
    assert_eq!(kept.text().await.unwrap(), "anonymous");

    // A broken rotation (a key that does not fit) leaves the new certificate in place.
    std::fs::write(
        dir.path().join("server-key.pem"),
        std::fs::read(old_ca.client("other").key).unwrap(),
    )
    .unwrap();
    tokio::time::sleep(pd_service::tls::RELOAD_EVERY * 2).await;
    let fresh = client(&new_ca, None).build().unwrap();
    assert!(fresh.get(&url).send().await.unwrap().status().is_success());
}

#[tokio::test]
async fn client_certificates_are_verified_against_the_client_ca() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "test");
    let writers = TestCa::new(dir.path(), "writers");
    let port = start(&files(&ca.server("server"), Some(&writers))).await;
    let url = format!("https://localhost:{port}/who");

    let writer = writers.client("writer");
    let certified = client(&ca, Some(&writer)).build().unwrap();
    assert_eq!(
        certified
            .get(&url)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
        "certified"
    );
    let anonymous = client(&ca, None).build().unwrap();
    assert_eq!(
        anonymous
            .get(&url)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap(),
        "anonymous"
    );
    // A certificate from another CA is refused at the handshake.
    let forged = client(&ca, Some(&ca.client("forged"))).build().unwrap();
    assert!(forged.get(&url).send().await.is_err());

    // The writers' CA replaced in place: its new writers are let in, the old ones no more.
    let next = TestCa::new(dir.path(), "next");
    std::fs::copy(&next.ca, &writers.ca).unwrap();
    let next_writer = next.client("next-writer");
    let started = Instant::now();
    loop {
        let fresh = client(&ca, Some(&next_writer)).build().unwrap();
        if let Ok(answer) = fresh.get(&url).send().await {
            assert_eq!(answer.text().await.unwrap(), "certified");
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the new client CA was never read"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let old = client(&ca, Some(&writer)).build().unwrap();
    assert!(
        old.get(&url).send().await.is_err(),
        "the old CA's writer is refused"
    );
}

#[tokio::test]
async fn unusable_files_are_named_with_the_problem() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "test");
    let server = ca.server("server");
    let other = ca.server("other");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not a certificate").unwrap();
    let missing = dir.path().join("missing.pem");
    let cases = [
        (
            TlsFiles {
                cert: missing.clone(),
                key: server.key.clone(),
                client_ca: None,
            },
            "missing.pem",
            "No such file",
        ),
        (
            TlsFiles {
                cert: garbage.clone(),
                key: server.key.clone(),
                client_ca: None,
            },
            "garbage.pem",
            "no PEM certificate",
        ),
        (
            TlsFiles {
                cert: server.cert.clone(),
                key: server.cert.clone(),
                client_ca: None,
            },
            "server.pem",
            "no PEM private key",
        ),
        (
            TlsFiles {
                cert: server.cert.clone(),
                key: other.key.clone(),
                client_ca: None,
            },
            "other-key.pem",
            "does not fit the certificate",
        ),
        (
            TlsFiles {
                cert: server.cert.clone(),
                key: server.key.clone(),
                client_ca: Some(garbage.clone()),
            },
            "garbage.pem",
            "no PEM certificate",
        ),
    ];
    for (files, file, problem) in cases {
        let err = ServerTls::load(&files)
            .expect_err("unusable files")
            .to_string();
        assert!(err.contains(file) && err.contains(problem), "{err}");
    }
}

/// A client certificate as `openssl x509 -req` makes it without an extensions file (X.509 v1)
/// is named as such, with the fix, not as a key that does not fit it.
#[test]
fn a_version_1_certificate_is_named_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let openssl = |args: &[&str]| {
        let status = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir.path())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("openssl runs");
        assert!(status.success(), "openssl {args:?}");
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=test ca",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "client.key",
        "-out",
        "client.csr",
        "-subj",
        "/CN=client",
    ]);
    openssl(&[
        "x509",
        "-req",
        "-in",
        "client.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "client.pem",
        "-days",
        "1",
    ]);
    let (cert, key) = (dir.path().join("client.pem"), dir.path().join("client.key"));
    let err = pd_service::tls::read_key_pair(&cert, &key)
        .expect_err("a v1 certificate is refused")
        .to_string();
    assert!(
        err.contains("client.pem"),
        "names the certificate's file: {err}"
    );
    assert!(
        err.contains("X.509 v1") && err.contains("extendedKeyUsage=clientAuth"),
        "{err}"
    );
    assert!(!err.contains("does not fit"), "{err}");
}

/// A client that completes the TLS handshake choosing HTTP/2 and then sends nothing (not even
/// the preface) does not keep its connection: it is closed within about the header timeout.
#[tokio::test]
async fn a_silent_http2_connection_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "test");
    let port = start_with(
        &files(&ca.server("server"), None),
        Duration::from_millis(400),
    )
    .await;
    let roots = pd_service::tls::read_roots(&ca.ca).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(pd_service::tls::crypto())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let started = Instant::now();
    let mut sink = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut sink)).await;
    assert!(closed.is_ok(), "a silent HTTP/2 connection was kept");
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
}
