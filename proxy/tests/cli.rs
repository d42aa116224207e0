//! The real `pd-proxy` binary: clear start-up errors, environment fallbacks, serving and a
//! graceful stop on SIGTERM (with `--shutdown-delay`: not ready first, streams in flight
//! finished after), NIXL prefills without a bootstrap server in sequential mode.

mod common;

use std::time::{Duration, Instant};

use common::binary::{command, listening};
use common::{client, prefill_answer, wait_ready_at, Mock};
use serde_json::json;

/// Runs the binary, which must exit by itself within 10 s; returns its exit code and stderr.
async fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let child = command(args, env).spawn().unwrap();
    let output = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
        .await
        .expect("pd-proxy did not exit")
        .unwrap();
    (
        output.status.code().unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

#[tokio::test]
async fn start_up_errors_are_clear() {
    let cases: &[(&[&str], &str)] = &[
        (&["--decode", "http://127.0.0.1:1"], "no prefill server"),
        (&["--prefill", "http://127.0.0.1:1"], "no decode server"),
        (
            &[
                "--prefill",
                "127.0.0.1:8100",
                "--decode",
                "http://127.0.0.1:1",
            ],
            "invalid --prefill URL \"127.0.0.1:8100\"",
        ),
        (
            &["--prefill", "http://127.0.0.1:1", "--decode", "not a url"],
            "invalid --decode URL",
        ),
        (
            &[
                "--prefill",
                "http://127.0.0.1:1",
                "eight",
                "--decode",
                "http://127.0.0.1:1",
            ],
            "Invalid bootstrap port \"eight\"",
        ),
        (
            &[
                "--prefill",
                "http://127.0.0.1:1",
                "99999",
                "--decode",
                "http://127.0.0.1:1",
            ],
            "Invalid bootstrap port \"99999\"",
        ),
        (
            &[
                "--prefill",
                "http://127.0.0.1:1",
                "--decode",
                "http://127.0.0.1:1",
                "--port",
                "70000",
            ],
            "--port",
        ),
        (
            &[
                "--prefill",
                "http://127.0.0.1:1",
                "--decode",
                "http://127.0.0.1:1",
                "--policy",
                "random",
            ],
            "--policy",
        ),
    ];
    for (args, needle) in cases {
        let (code, stderr) = run(args, &[]).await;
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

#[tokio::test]
async fn unusable_tls_files_are_named_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let ca = pd_service::test_certs::TestCa::new(dir.path(), "test");
    let server = ca.server("server");
    let other = ca.server("other");
    let garbage = dir.path().join("garbage.pem");
    std::fs::write(&garbage, "not PEM at all").unwrap();
    let path = |p: &std::path::Path| p.display().to_string();
    let (cert, key, other_key, garbage) = (
        path(&server.cert),
        path(&server.key),
        path(&other.key),
        path(&garbage),
    );
    let fleet = [
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:1",
    ];
    // (flags, exit code, what stderr names): the listener's files fail at bind (1), the
    // upstream's at validation (2), each naming the file and the problem.
    let cases: Vec<(Vec<&str>, i32, [&str; 2])> = vec![
        (
            vec!["--tls-cert", &garbage, "--tls-key", &key],
            1,
            ["garbage.pem", "no PEM certificate"],
        ),
        (
            vec!["--tls-cert", &cert, "--tls-key", &other_key],
            1,
            ["other-key.pem", "does not fit"],
        ),
        (vec!["--tls-cert", &cert], 2, ["--tls-key", "required"]),
        (
            vec!["--upstream-ca", &garbage],
            2,
            ["garbage.pem", "no PEM certificate"],
        ),
        (
            vec!["--upstream-cert", &cert, "--upstream-key", &garbage],
            2,
            ["garbage.pem", "private key"],
        ),
    ];
    for (flags, expected, needles) in cases {
        let args: Vec<&str> = fleet.iter().copied().chain(flags.iter().copied()).collect();
        let (code, stderr) = run(&args, &[]).await;
        assert_eq!(code, expected, "{flags:?}: {stderr}");
        for needle in needles {
            assert!(stderr.contains(needle), "{flags:?}: {stderr}");
        }
    }
}

/// Runs `pd-proxy ARGS` to its end: its exit code, stdout and stderr.
async fn check(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let output = command(args, env)
        .stdout(std::process::Stdio::piped())
        .output();
    let output = output.await.unwrap();
    let text = |bytes: Vec<u8>| String::from_utf8(bytes).unwrap();
    (
        output.status.code().unwrap(),
        text(output.stdout),
        text(output.stderr),
    )
}

#[tokio::test]
async fn check_config_prints_the_effective_configuration_and_names_mistakes() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("proxy.toml");
    std::fs::write(
        &file,
        "port = 9100\n[backends]\ndecode = [\"http://d:1\"]\nprefill = [\"http://p:1 9000\"]\n\
         [routing]\npolicy = \"cache_aware\"\n[admin]\nadmin-key = \"s3cret-admin\"\n\
         [aliases]\nsmall = \"m\"\n",
    )
    .unwrap();
    let path = file.display().to_string();
    let env = [("PD_PROXY_REQUEST_TIMEOUT", "12")];
    let (code, out, err) = check(&["check-config", &path, "--api-key", "sk-cli"], &env).await;
    assert_eq!(code, 0, "{err}");
    for expected in [
        "[listen]\n",
        "port = 9100  # file",
        "host = \"127.0.0.1\"  # default",
        "policy = \"cache_aware\"  # file",
        "request-timeout = 12  # env PD_PROXY_REQUEST_TIMEOUT",
        "# api-key = <a secret, not shown>  # command line",
        "# admin-key = <a secret, not shown>  # file",
        "[aliases]\n\"small\" = \"m\"",
        "valid",
    ] {
        assert!(out.contains(expected), "{expected:?} in\n{out}");
    }
    assert!(!out.contains("s3cret") && !out.contains("sk-cli"), "{out}");
    // The flat `port` is read, with a note saying where it belongs.
    assert!(err.contains("`port` under [listen]"), "{err}");
    // What it prints starts the same proxy: read back, it says the same.
    let again = dir.path().join("effective.toml");
    std::fs::write(&again, &out).unwrap();
    let again = again.display().to_string();
    let (code, reread, _) = check(&["check-config", &again], &[]).await;
    assert_eq!(code, 0);
    let values = |text: &str| -> Vec<String> {
        let lines = text
            .lines()
            .filter(|l| l.contains(" = ") && !l.starts_with('#'));
        lines
            .map(|l| l.split("  #").next().unwrap().to_owned())
            .collect()
    };
    assert_eq!(values(&reread), values(&out));

    let cases = [
        ("[routing]\nport = 1\n", "`port` belongs in [listen]"),
        ("[backends]\ndecode = [\"http://d:1\"]\nprefill = [\"http://p:1\"]\n[listen]\ntls-cert = \"/no/cert.pem\"\ntls-key = \"/no/key.pem\"\n", "/no/cert.pem"),
        ("[backends]\ndecode = [\"http://d:1\"]\nprefill = [\"http://p:1\"]\n[admin]\napi-keys-file = \"/no/keys.toml\"\n", "/no/keys.toml"),
        ("[backends]\ndecode = [\"http://d:1\"]\n", "no prefill server"),
    ];
    for (text, expected) in cases {
        std::fs::write(&file, text).unwrap();
        let (code, _, err) = check(&["check-config", &path], &[]).await;
        assert_eq!(code, 2, "{text:?}");
        assert!(err.contains(expected), "{text:?}: {err}");
    }
}

#[tokio::test]
async fn environment_variables_stand_in_for_flags() {
    let (code, stderr) = run(
        &[],
        &[
            (
                "PD_PROXY_PREFILL",
                "http://127.0.0.1:1 8998,http://127.0.0.1:2 x",
            ),
            ("PD_PROXY_DECODE", "http://127.0.0.1:3"),
        ],
    )
    .await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("Invalid bootstrap port \"x\""), "{stderr}");
    let (code, stderr) = run(&[], &[("PD_PROXY_PREFILL", "http://127.0.0.1:1")]).await;
    assert_eq!(code, 2);
    assert!(stderr.contains("no decode server"), "{stderr}");
}

/// Starts the binary, which must say where it listens within 10 s; returns it and that
/// address. Its stderr keeps being drained so it never blocks on a full pipe.
#[tokio::test]
async fn serves_and_stops_gracefully_on_sigterm() {
    let (mut child, addr) = listening(
        &[
            "--prefill",
            "http://127.0.0.1:9",
            "none",
            "--decode",
            "http://127.0.0.1:9",
            "--port",
            "0",
        ],
        &[("RUST_LOG", "info"), ("PD_PROXY_HOST", "127.0.0.1")],
    )
    .await;
    let client = client();
    let health = client
        .get(format!("http://{addr}/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let ready = client
        .get(format!("http://{addr}/ready"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    let body: serde_json::Value = ready.json().await.unwrap();
    assert_eq!(
        body["prefills"][0]["bootstrap_addr"],
        "http://127.0.0.1:8998"
    );
    let pid = i32::try_from(child.id().unwrap()).unwrap();
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("pd-proxy did not stop on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn sigterm_turns_readiness_off_for_the_delay_then_finishes_streams_in_flight() {
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    // A streamed answer takes 1.6 s after its first chunk; a whole one comes at once.
    decode.set(|b| b.chunk_gap = Duration::from_millis(800));
    let (prefill_url, decode_url) = (prefill.url(), decode.url());
    let delay = Duration::from_secs(1);
    let (mut child, addr) = listening(
        &[
            "--mode",
            "sequential",
            "--prefill",
            &prefill_url,
            "--decode",
            &decode_url,
            "--port",
            "0",
            "--shutdown-grace",
            "10",
        ],
        &[("RUST_LOG", "info"), ("PD_PROXY_SHUTDOWN_DELAY", "1")],
    )
    .await;
    let url = format!("http://{addr}");
    wait_ready_at(&url).await;
    let client = client();
    let completion = |stream: bool| {
        (client.post(format!("{url}/v1/completions")))
            .json(&json!({"prompt": "hi", "stream": stream}))
            .send()
    };
    let mut stream = completion(true).await.unwrap();
    assert_eq!(stream.status(), 200);
    let mut streamed = String::from_utf8(stream.chunk().await.unwrap().unwrap().to_vec()).unwrap();

    let signalled = Instant::now();
    let pid = i32::try_from(child.id().unwrap()).unwrap();
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let ready = loop {
        let ready = client.get(format!("{url}/ready")).send().await.unwrap();
        if ready.status() == 503 {
            break ready;
        }
        assert!(signalled.elapsed() < Duration::from_secs(5), "still ready");
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let took = signalled.elapsed();
    assert!(
        took < Duration::from_millis(250),
        "not ready after {took:?}"
    );
    let body: serde_json::Value = ready.json().await.unwrap();
    assert_eq!(
        (&body["status"], &body["detail"]),
        (&json!("not_ready"), &json!("shutting down"))
    );
    assert_eq!(body["prefills"][0]["url"], prefill_url.as_str(), "{body}");
    // Everything else is served as usual, each answer closing its connection.
    let health = client.get(format!("{url}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let answer = completion(false).await.unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers()["connection"], "close");
    assert!(
        signalled.elapsed() < delay,
        "the checks outlasted the delay"
    );

    // After the delay: new connections are refused, while the stream goes on to its end.
    while tokio::net::TcpStream::connect(&addr).await.is_ok() {
        assert!(signalled.elapsed() < delay * 2, "still accepting");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let closed = signalled.elapsed();
    assert!(closed >= delay - Duration::from_millis(50), "{closed:?}");
    while let Some(chunk) = stream.chunk().await.unwrap() {
        streamed.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    assert!(signalled.elapsed() > closed);
    assert!(
        streamed.contains("Hel") && streamed.ends_with("data: [DONE]\n\n"),
        "{streamed}"
    );

    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("pd-proxy exits within the grace")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn in_sequential_mode_a_prefill_without_a_port_needs_no_bootstrap_server() {
    let prefill = Mock::prefill().await;
    let decode = Mock::decode().await;
    let (prefill_url, decode_url) = (prefill.url(), decode.url());
    let (_child, addr) = listening(
        &[
            "--mode",
            "sequential",
            "--prefill",
            &prefill_url,
            "--decode",
            &decode_url,
            "--port",
            "0",
        ],
        &[("RUST_LOG", "info")],
    )
    .await;
    let url = format!("http://{addr}");
    wait_ready_at(&url).await;
    let answer = client()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let d = decode.wait_seen(1).await.remove(0);
    assert_eq!(
        d.body["kv_transfer_params"],
        prefill_answer()["kv_transfer_params"]
    );
}
