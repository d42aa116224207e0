//! The `worker-client` binary: output and exit code of every subcommand.

mod common;

use std::time::Duration;

use bootstrap_server::registry::ExpectedTopology;
use bootstrap_server::server::ServerHandle;
use bootstrap_server::{Server, ServerConfig};
use common::cli;

async fn start(dir: &std::path::Path, expected: Option<ExpectedTopology>) -> ServerHandle {
    let mut config = ServerConfig::local(dir);
    config.registry.expected = expected;
    // Engines shown as soon as their ranks are whole: these tests register before they look.
    config.registry.settle = std::time::Duration::ZERO;
    Server::bind(config).await.unwrap().spawn()
}

#[tokio::test]
async fn register_query_and_deregister() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), None).await;
    let url = server.url();
    let register = |engine: &'static str, tp: &'static str| {
        let url = url.clone();
        async move {
            cli(
                &url,
                &[
                    "register",
                    "--engine-id",
                    engine,
                    "--dp-rank",
                    "0",
                    "--tp-rank",
                    tp,
                    "--addr",
                    "tcp://10.0.0.5:4000",
                    // Refuse to take a slot over, whatever the server's policy.
                    "--replace",
                    "false",
                ],
            )
            .await
        }
    };
    let run = register("engine-a", "0").await;
    assert_eq!(
        (run.code, run.stdout.trim()),
        (0, "registered"),
        "{}",
        run.stderr
    );

    let run = register("engine-b", "1").await;
    assert_eq!(run.code, 1, "a conflict exits 1");
    assert!(
        run.stderr
            .contains("Engine ID mismatch for dp_rank=0: expected engine-a, got engine-b"),
        "{}",
        run.stderr
    );

    let run = cli(&url, &["query"]).await;
    assert_eq!(run.code, 0);
    assert!(
        run.stdout.contains("DP")
            && run.stdout.contains("engine-a")
            && run.stdout.contains("tcp://10.0.0.5:4000"),
        "{}",
        run.stdout
    );

    let run = cli(&url, &["query", "--json"]).await;
    let json: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(json["0"]["worker_addr"]["0"]["0"], "tcp://10.0.0.5:4000");

    let run = cli(&url, &["query", "--engine-id", "nope"]).await;
    assert_eq!(run.code, 1);
    assert!(run.stderr.contains("404"), "{}", run.stderr);

    let run = cli(&url, &["deregister", "--engine-id", "engine-a"]).await;
    assert_eq!((run.code, run.stdout.trim()), (0, "removed 1 worker(s)"));
    let run = cli(&url, &["query"]).await;
    assert_eq!(run.stdout.trim(), "no workers registered");
}

#[tokio::test]
async fn request_ids() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), None).await;
    let url = server.url();
    cli(
        &url,
        &["register", "--engine-id", "e", "--addr", "tcp://p:1"],
    )
    .await;
    let run = cli(
        &url,
        &["requests", "register", "--req-id", "r1", "--dp-rank", "0"],
    )
    .await;
    assert_eq!(
        (run.code, run.stdout.trim()),
        (0, "registered r1 -> dp rank 0")
    );

    let run = cli(&url, &["requests", "query", "r1", "r2"]).await;
    assert_eq!(run.code, 1, "r2 did not resolve");
    assert_eq!(run.stdout, "r1\tok\ttcp://p:1\nr2\tretry\n");

    let run = cli(&url, &["requests", "query", "--json", "r1"]).await;
    assert_eq!(run.code, 0);
    let json: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(
        json,
        serde_json::json!({"results": {"r1": ["ok", ["tcp://p:1"]]}})
    );

    let run = cli(&url, &["requests", "release", "r1"]).await;
    assert_eq!((run.code, run.stdout.trim()), (0, "released"));
    let run = cli(&url, &["requests", "release", "r1"]).await;
    assert_eq!((run.code, run.stdout.trim()), (0, "not live"));
}

#[tokio::test]
async fn wait_ready_exit_codes() {
    let dir = tempfile::tempdir().unwrap();
    let expected = ExpectedTopology {
        dp_size: 1,
        tp_size: 2,
        pp_size: 1,
    };
    let server = start(dir.path(), Some(expected)).await;
    let url = server.url();
    let run = cli(&url, &["wait-ready", "--wait-timeout", "0.5"]).await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(
        run.stderr.contains("2 of 2 workers have not registered"),
        "{}",
        run.stderr
    );

    for tp in ["0", "1"] {
        cli(
            &url,
            &[
                "register",
                "--engine-id",
                "e",
                "--tp-rank",
                tp,
                "--addr",
                &format!("tcp://p:{}", 10 + tp.len()),
            ],
        )
        .await;
    }
    let run = cli(&url, &["wait-ready", "--wait-timeout", "5"]).await;
    assert_eq!(
        (run.code, run.stdout.trim()),
        (0, "ready: 2/2 workers registered")
    );
}

#[tokio::test]
async fn unreachable_server_and_bad_usage() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let run = cli(&url, &["query", "--timeout", "0.5"]).await;
    assert_eq!(run.code, 3, "{}", run.stderr);
    assert!(run.stderr.contains("cannot connect"), "{}", run.stderr);

    let run = cli(
        &url,
        &[
            "register",
            "--engine-id",
            "e",
            "--addr",
            "tcp://p:1",
            "--deadline",
            "0.5",
        ],
    )
    .await;
    assert_eq!(run.code, 3);
    assert!(run.stderr.contains("gave up"), "{}", run.stderr);

    let run = cli(&url, &["register", "--addr", "tcp://p:1"]).await;
    assert_eq!(run.code, 2, "missing --engine-id is a usage error");
    let run = cli("not a url", &["query"]).await;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("invalid bootstrap URL"),
        "{}",
        run.stderr
    );
}

/// The CLI running in the background, its stdout read line by line.
struct Background {
    child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl Background {
    fn spawn(url: &str, args: &[&str]) -> Self {
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_worker-client"))
            .arg("--url")
            .arg(url)
            .args(args)
            .env_remove("PD_BOOTSTRAP_TOKEN")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        Background {
            child,
            lines: tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout)),
        }
    }

    /// The next line of stdout (bounded wait).
    async fn line(&mut self) -> String {
        tokio::time::timeout(Duration::from_secs(5), self.lines.next_line())
            .await
            .expect("a line in time")
            .unwrap()
            .expect("stdout still open")
    }

    /// Sends SIGTERM and returns the exit code (bounded wait).
    async fn terminate(mut self) -> i32 {
        let pid = self.child.id().expect("still running") as libc::pid_t;
        // SAFETY: kill(2) with a pid this test spawned and still owns.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let status = tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .expect("exits after SIGTERM")
            .unwrap();
        status.code().unwrap_or(-1)
    }
}

#[tokio::test]
async fn register_with_a_lease_keeps_the_worker_until_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), None).await;
    let mut sidecar = Background::spawn(
        &server.url(),
        &[
            "register",
            "--engine-id",
            "e",
            "--addr",
            "tcp://p:1",
            "--lease-ttl",
            "1",
        ],
    );
    let line = sidecar.line().await;
    assert!(
        line.starts_with("registered under lease ") && line.contains("(ttl 1 s)"),
        "{line}"
    );
    let lease: i64 = line.split(' ').nth(3).unwrap().parse().unwrap();
    // Alive across more than two ttls: the sidecar keeps it.
    let until = std::time::Instant::now() + Duration::from_millis(2500);
    while std::time::Instant::now() < until {
        let (_, workers) = server.registry().list();
        assert_eq!(workers.len(), 1);
        assert_eq!(workers[0].lease.map(|l| l.id), Some(lease));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(sidecar.terminate().await, 0);
    assert!(
        server.registry().list().1.is_empty(),
        "revoked before exiting, not left to expire"
    );
}

#[tokio::test]
async fn watch_prints_the_snapshot_then_each_event_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), None).await;
    let url = server.url();
    let mut watch = Background::spawn(&url, &["watch", "--json"]);
    let snapshot: serde_json::Value = serde_json::from_str(&watch.line().await).unwrap();
    assert_eq!(snapshot["type"], "snapshot");
    assert_eq!(snapshot["workers"], serde_json::json!([]));
    let run = cli(
        &url,
        &[
            "register",
            "--engine-id",
            "e",
            "--dp-rank",
            "2",
            "--addr",
            "tcp://p:7",
        ],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let event: serde_json::Value = serde_json::from_str(&watch.line().await).unwrap();
    assert_eq!(event["type"], "put");
    assert_eq!(
        event["worker"],
        serde_json::json!({"engine_id": "e", "dp_rank": 2, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://p:7",
                           "incarnation": 1})
    );
    assert!(event["revision"].as_u64().unwrap() > snapshot["revision"].as_u64().unwrap());
    assert_eq!(watch.terminate().await, 0);

    // The text form: one tab-separated line per change.
    let since = event["revision"].to_string();
    let mut watch = Background::spawn(&url, &["watch", "--since", &since]);
    cli(&url, &["deregister", "--engine-id", "e"]).await;
    let line = watch.line().await;
    assert!(
        line.ends_with("\tdelete\te\t2\t0\t0\ttcp://p:7\t-"),
        "{line}"
    );
    assert_eq!(watch.terminate().await, 0);
}

#[tokio::test]
async fn drain_marks_an_engine_and_undo_lifts_it() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path(), None).await;
    let url = server.url();
    let args = [
        "register",
        "--engine-id",
        "p0",
        "--addr",
        "tcp://10.0.0.5:4000",
    ];
    assert_eq!(cli(&url, &args).await.code, 0);
    let draining = |url: String| async move {
        let workers: serde_json::Value = reqwest::get(format!("{url}/workers"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        workers["workers"][0]["draining"].as_bool().unwrap_or(false)
    };
    let run = cli(&url, &["drain", "p0"]).await;
    assert_eq!(
        (run.code, run.stdout.trim()),
        (0, "engine p0 (1 worker(s)) is draining"),
        "{}",
        run.stderr
    );
    assert!(draining(url.clone()).await);
    let run = cli(&url, &["drain", "p0", "--undo"]).await;
    assert_eq!(
        run.stdout.trim(),
        "engine p0 (1 worker(s)) takes requests again"
    );
    assert!(!draining(url.clone()).await);
    let run = cli(&url, &["drain", "nobody"]).await;
    assert_eq!(run.code, 1, "an unknown engine exits 1");
    assert!(run.stderr.contains("nobody"), "{}", run.stderr);
}

#[tokio::test]
async fn https_with_a_ca_file_and_a_client_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let ca = pd_service::test_certs::TestCa::new(dir.path(), "registry");
    let server_cert = ca.server("server");
    let writer = ca.client("writer");
    let mut config = ServerConfig::local(dir.path());
    config.registry.settle = std::time::Duration::ZERO;
    config.tls = Some(pd_service::TlsFiles {
        cert: server_cert.cert.clone(),
        key: server_cert.key.clone(),
        client_ca: Some(ca.ca.clone()),
    });
    let server = Server::bind(config).await.unwrap().spawn();
    let url = format!("https://localhost:{}", server.addr().port());
    let path = |p: &std::path::Path| p.display().to_string();
    let (ca_file, cert, key) = (path(&ca.ca), path(&writer.cert), path(&writer.key));
    let register = [
        "register",
        "--engine-id",
        "e",
        "--addr",
        "tcp://10.0.0.5:4000",
        "--deadline",
        "1",
    ];
    let tls = [
        "--ca-file",
        &ca_file,
        "--cert-file",
        &cert,
        "--key-file",
        &key,
    ];
    let run = cli(&url, &[&register[..], &tls[..]].concat()).await;
    assert_eq!(
        (run.code, run.stdout.trim()),
        (0, "registered"),
        "{}",
        run.stderr
    );
    // The CA alone reads, and a write without the certificate is refused (exit 1).
    let run = cli(&url, &["query", "--ca-file", &ca_file]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("tcp://10.0.0.5:4000"), "{}", run.stdout);
    let run = cli(
        &url,
        &[&register[..], &["--ca-file", &ca_file][..]].concat(),
    )
    .await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(run.stderr.contains("--tls-client-ca"), "{}", run.stderr);
    // An unusable file is bad usage (exit 2), named.
    let run = cli(&url, &["query", "--ca-file", "/no/such/ca.pem"]).await;
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("/no/such/ca.pem"), "{}", run.stderr);
    server.shutdown().await.unwrap();
}
