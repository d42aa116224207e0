//! The real `pd-proxy` binary: clear start-up errors, environment fallbacks, serving and a
//! graceful stop on SIGTERM, NIXL prefills without a bootstrap server in sequential mode.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{client, prefill_answer, wait_ready_at, Mock};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const BIN: &str = env!("CARGO_BIN_EXE_pd-proxy");

fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

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
async fn listening(args: &[&str], env: &[(&str, &str)]) -> (Child, String) {
    let mut child = command(args, env).spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(rest) = line.split("addr=").nth(1) {
                if line.contains("pd-proxy listening") {
                    return rest.split_whitespace().next().unwrap().to_owned();
                }
            }
        }
        panic!("pd-proxy exited without listening")
    })
    .await
    .expect("pd-proxy never said where it listens");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, addr)
}

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
