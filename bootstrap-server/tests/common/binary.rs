//! The real `bootstrap-server` binary, started on an ephemeral port.

use std::ffi::OsStr;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStderr, Command};

/// The server's stderr, read line by line.
pub type LogLines = Lines<BufReader<ChildStderr>>;

/// Starts `bootstrap-server` on an ephemeral port with `--data-dir DIR` (one argument) or the
/// given flags, and returns it with its base URL.
pub async fn start_binary(args: &[&OsStr]) -> (Child, String) {
    let (child, url, mut lines) = start_binary_unread(args).await;
    // Keep draining stderr so the server never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, url)
}

/// [`start_binary`], leaving the rest of its stderr unread: the caller drains it or not.
pub async fn start_binary_unread(args: &[&OsStr]) -> (Child, String, LogLines) {
    start_binary_with_env(args, &[]).await
}

/// [`start_binary_unread`] with these environment variables.
pub async fn start_binary_with_env(
    args: &[&OsStr],
    env: &[(&str, &str)],
) -> (Child, String, LogLines) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_bootstrap-server"));
    // Engines shown as soon as their ranks are whole (the tests register every rank before
    // they look); a test of the settle window sets it.
    command.env("PD_BOOTSTRAP_SETTLE", "0");
    command.envs(env.iter().copied());
    command.args(["--host", "127.0.0.1", "--port", "0", "--log-format", "json"]);
    match args {
        [data_dir] => command.arg("--data-dir").arg(data_dir),
        flags => command.args(flags),
    };
    let mut child = command
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the bootstrap-server binary starts");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            let event: Value = serde_json::from_str(&line).unwrap_or_default();
            if event["fields"]["message"] == "bootstrap server listening" {
                return event["fields"]["addr"].as_str().unwrap().to_owned();
            }
        }
        panic!("the server exited before listening");
    })
    .await
    .expect("the server listens within 30 s");
    (child, format!("http://{addr}"), lines)
}

/// `GET url` as JSON.
pub async fn get_json(url: &str) -> Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}
