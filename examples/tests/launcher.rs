//! The `pd-cluster` launcher as a user runs it: a taken port fails at once, a kill -9 leaves no
//! process behind, and SIGTERM stops everything in order within 2 s, the prefills' leases revoked.
//!
//! Needs the workspace binaries in the test's target folder, which `cargo test --workspace`
//! builds.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn launcher(run_dir: &Path, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_pd-cluster"));
    command
        .arg("--run-dir")
        .arg(run_dir)
        .args([
            "--prefill-us-per-token",
            "50",
            "--decode-ms-per-token",
            "1",
            "--lease-ttl",
            "5",
        ])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Reads the launcher's output until the demo requests are done (it then serves until a
/// signal); returns the proxy's URL. The rest of the output is drained on a thread, so the
/// launcher never writes to a closed pipe.
fn wait_running(child: &mut Child) -> String {
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let mut proxy = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(url) = line.trim().strip_prefix("proxy: ") {
            proxy = url.to_owned();
        }
        if line.contains("The cluster is running") {
            std::thread::spawn(move || lines.for_each(drop));
            return proxy;
        }
    }
    panic!("the launcher ended before running");
}

/// Every thread's children (tokio spawns from its worker threads).
fn all_children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for task in tasks.flatten() {
        let path: PathBuf = task.path().join("children");
        if let Ok(text) = std::fs::read_to_string(path) {
            pids.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    pids
}

fn alive(pid: u32) -> bool {
    // A zombie is dead for our purpose: its memory and sockets are gone.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|stat| !stat.contains(") Z "))
        .unwrap_or(false)
}

#[test]
fn a_taken_port_fails_at_once_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let started = Instant::now();
    let output = launcher(dir.path(), &["--once"])
        .args(["--port", &port])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("port {port}")) && stderr.contains("--port"),
        "{stderr}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    // The same with --base-port: the first port it would take is busy.
    let output = launcher(dir.path(), &["--once", "--base-port", &port])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains(&format!("port {port}")) && stderr.contains("--base-port"),
        "{stderr}"
    );
}

#[test]
fn gpus_are_refused_where_no_gpu_build_of_vllm_runs() {
    let dir = tempfile::tempdir().unwrap();
    // (arguments, what the error names)
    let table: [(&[&str], &str); 3] = [
        (&["--gpus", "0,1"], "--engine vllm"),
        (&["--engine", "vllm", "--gpus", "0,1"], "--vllm-python"),
        (
            &[
                "--engine",
                "vllm",
                "--vllm-python",
                "/usr/bin/python3",
                "--gpus",
                "a",
            ],
            "GPU indexes",
        ),
    ];
    for (args, named) in table {
        let output = launcher(dir.path(), args).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{args:?}: {stderr}");
        assert!(stderr.contains(named), "{args:?}: {stderr}");
    }
}

#[test]
fn a_killed_launcher_leaves_no_process_behind() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = launcher(dir.path(), &["--port", "0"]).spawn().unwrap();
    let proxy = wait_running(&mut child);
    let pids = all_children(child.id());
    assert_eq!(
        pids.len(),
        7,
        "2 bootstrap servers, 2 prefills, 2 decodes, the proxy: {pids:?}"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    while pids.iter().any(|pid| alive(*pid)) {
        assert!(
            Instant::now() < deadline,
            "survivors: {:?}",
            pids.iter().filter(|p| alive(**p)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let addr = proxy.trim_start_matches("http://");
    assert!(
        std::net::TcpStream::connect(addr).is_err(),
        "the proxy's port is free"
    );
}

#[test]
fn sigterm_stops_everything_in_order_within_two_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = launcher(dir.path(), &["--port", "0"]).spawn().unwrap();
    wait_running(&mut child);
    let stopping = Instant::now();
    // SAFETY: kill(2) on the child we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let took = stopping.elapsed();
    assert!(status.success(), "{status}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    // The prefills revoked their leases while the bootstrap servers still ran.
    for i in 0..2 {
        let log = std::fs::read_to_string(dir.path().join(format!("bootstrap-{i}.log"))).unwrap();
        assert!(log.contains("lease revoked"), "bootstrap-{i}.log:\n{log}");
    }
    eprintln!("SIGTERM to exit: {took:?}");
}

/// The one command behind Envoy (`--gateway envoy --once`): the demo's requests answered
/// through Envoy, pd-epp and the sidecars, everything stopped after, nothing left behind.
#[test]
fn the_gateway_demo_answers_through_envoy_and_leaves_nothing() {
    let envoy = pd_examples::cluster::gateway::envoy_binary().expect("Envoy");
    let dir = tempfile::tempdir().unwrap();
    let mut child = launcher(dir.path(), &["--port", "0", "--once", "--gateway", "envoy"])
        .arg("--envoy")
        .arg(&envoy)
        .spawn()
        .unwrap();
    let mut out = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}\n{out}");
    assert!(out.contains("gateway: Envoy at http://127.0.0.1:"), "{out}");
    assert!(
        out.contains("endpoint picker: pd-epp at 127.0.0.1:"),
        "{out}"
    );
    assert_eq!(out.matches("TTFT").count(), 4, "{out}");
    // Envoy (its configuration in the run folder) and the rest are gone.
    let run_dir = dir.path().to_string_lossy().into_owned();
    let left: Vec<String> = (std::fs::read_dir("/proc").unwrap().flatten())
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            (cmdline.contains(&run_dir) && alive(pid)).then_some(cmdline)
        })
        .collect();
    assert!(left.is_empty(), "left running: {left:?}");
    let access = std::fs::read_to_string(dir.path().join("envoy.log")).unwrap();
    assert!(access.matches("\"POST /v1/").count() >= 4, "{access}");
}

/// A decode sim-engine on a free port, with `extra` flags; killed on drop.
struct Decode(Child, String);

impl Drop for Decode {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn decode(extra: &[&str]) -> Decode {
    let port = pd_examples::cluster::free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_sim-engine"))
        .args(["--role", "decode", "--port", &port.to_string()])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "sim-engine did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    Decode(child, url)
}

#[tokio::test]
async fn a_decode_honours_its_kv_wait_when_the_prefill_is_frozen() {
    // A "bootstrap server" that accepts and never answers.
    let frozen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let frozen_url = format!("http://{}", frozen.local_addr().unwrap());
    let decode = decode(&["--kv-wait", "1"]);
    let started = Instant::now();
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/completions", decode.1))
        .json(
            &serde_json::json!({"model": "sim-model", "prompt": "hi", "max_tokens": 2,
            "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
                "remote_bootstrap_addr": frozen_url, "remote_engine_id": "e", "transfer_id": "x"}}),
        )
        .timeout(Duration::from_secs(20))
        .send()
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(answer.status(), 504);
    assert!(took < Duration::from_millis(1800), "{took:?}");
    assert!(answer.text().await.unwrap().contains("--kv-wait"));
    drop(frozen);
}

#[tokio::test]
async fn a_body_over_the_sim_limit_gets_413() {
    let decode = decode(&["--max-body-bytes", "1000"]);
    let answer = reqwest::Client::new()
        .post(format!("{}/v1/completions", decode.1))
        .json(&serde_json::json!({"model": "sim-model", "prompt": "x".repeat(2000)}))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 413);
}
