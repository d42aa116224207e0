//! The real `pd-proxy` binary, started with a clean environment.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const BIN: &str = env!("CARGO_BIN_EXE_pd-proxy");

/// The binary with `args` and only the environment `env`, its stderr piped.
pub fn command(args: &[&str], env: &[(&str, &str)]) -> Command {
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

/// Starts the binary and returns it with the address it says it listens on (its stderr then
/// drained in the background).
pub async fn listening(args: &[&str], env: &[(&str, &str)]) -> (Child, String) {
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

/// The binary in front of `prefill` (its bootstrap server `bootstrap`) and `decodes`, with
/// `args` after those and only the environment `env`; once ready: the process and its URL.
pub async fn in_front_of(
    prefill: &super::Mock,
    bootstrap: &super::Bootstrap,
    decodes: &[&super::Mock],
    args: &[&str],
    env: &[(&str, &str)],
) -> (Child, String) {
    let port = bootstrap.url().rsplit(':').next().unwrap().to_owned();
    let prefill = prefill.url();
    let decodes: Vec<String> = decodes.iter().map(|decode| decode.url()).collect();
    let mut all = vec![
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--prefill",
        &prefill,
        &port,
    ];
    for decode in &decodes {
        all.extend(["--decode", decode.as_str()]);
    }
    all.extend_from_slice(args);
    let (child, addr) = listening(&all, env).await;
    let url = format!("http://{addr}");
    super::wait_ready_at(&url).await;
    (child, url)
}
