//! The UCX data plane between two processes on 127.0.0.1, both the real `kv-transfer` binary:
//! one exports (P), one pulls and verifies every byte against the pattern (D). Shared memory
//! (`UCX_TLS=posix,sysv,self`) and TCP (`UCX_TLS=tcp`); an exporter killed mid-transfer; and
//! repeated connect/transfer/disconnect cycles under valgrind, which must leak nothing.

#![cfg(feature = "ucx")]

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_kv-transfer");
const SHM: &str = "posix,sysv,self";
const TCP: &str = "tcp";
const MIB: usize = 1 << 20;

/// A `kv-transfer export` child; killed on drop.
struct Exporter {
    child: Child,
    stdin: Option<ChildStdin>,
    addr: String,
    lines: mpsc::Receiver<String>,
}

impl Exporter {
    /// Starts `[wrapper...] kv-transfer export --transport ucx <args>` with `UCX_TLS=tls` and
    /// waits for its address.
    fn start(tls: &str, wrapper: &[String], args: &[String]) -> Self {
        let (program, before) = match wrapper.split_first() {
            Some((program, rest)) => (program.as_str(), rest.to_vec()),
            None => (BIN, Vec::new()),
        };
        let mut command = Command::new(program);
        if !wrapper.is_empty() {
            command.args(&before).arg(BIN);
        }
        let mut child = command
            .args(["export", "--transport", "ucx", "--id", "t"])
            .args(args)
            .env("UCX_TLS", tls)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("kv-transfer starts");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(60))
            .expect("the exporter prints its address");
        let addr = first.strip_prefix("addr ").expect("addr line").to_owned();
        let stdin = child.stdin.take();
        Exporter {
            child,
            stdin,
            addr,
            lines,
        }
    }

    /// Closes standard input (the exporter exits cleanly) and waits.
    fn finish(mut self) -> ExitStatus {
        drop(self.stdin.take());
        self.child.wait().unwrap()
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// `[wrapper...] kv-transfer pull` as a child with piped output.
fn pull_command(tls: &str, wrapper: &[String], addr: &str, args: &[String]) -> Command {
    let mut command = match wrapper.split_first() {
        Some((program, rest)) => {
            let mut c = Command::new(program);
            c.args(rest).arg(BIN);
            c
        }
        None => Command::new(BIN),
    };
    command
        .args(["pull", "--addr", addr, "--id", "t"])
        .args(args)
        .env("UCX_TLS", tls)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// The JSON lines D printed.
fn reports(stdout: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

fn moves_64_mib_verified(tls: &str) {
    let bytes = (64 * MIB).to_string();
    let exporter = Exporter::start(
        tls,
        &[],
        &strings(&["--bytes", &bytes, "--count", "2", "--pool-mib", "160"]),
    );
    let output = pull_command(
        tls,
        &[],
        &exporter.addr,
        &strings(&["--bytes", &bytes, "--count", "2", "--deadline", "60"]),
    )
    .output()
    .unwrap();
    let lines = reports(&output.stdout);
    assert!(
        output.status.success(),
        "{lines:?} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(lines.len(), 2, "{lines:?}");
    for line in &lines {
        assert_eq!(line["ok"], true, "verified byte for byte: {line}");
    }
    assert!(exporter.finish().success());
}

#[test]
fn shared_memory_moves_64_mib_verified() {
    moves_64_mib_verified(SHM);
}

#[test]
fn tcp_moves_64_mib_verified() {
    moves_64_mib_verified(TCP);
}

/// Starts a 256 MiB pull, SIGKILLs P as soon as D holds the descriptor, and returns D's exit
/// status, its reports and how long it took after the kill.
fn kill_exporter_mid_transfer(tls: &str, deadline_secs: u64) -> (ExitStatus, Vec<Value>, Duration) {
    let bytes = (256 * MIB).to_string();
    let mut exporter = Exporter::start(
        tls,
        &[],
        &strings(&["--bytes", &bytes, "--pool-mib", "272"]),
    );
    let mut puller = pull_command(
        tls,
        &[],
        &exporter.addr,
        &strings(&["--bytes", &bytes, "--deadline", &deadline_secs.to_string()]),
    )
    .spawn()
    .unwrap();
    let signal = exporter
        .lines
        .recv_timeout(Duration::from_secs(60))
        .expect("P reports D pulling");
    assert_eq!(signal, "pulling");
    exporter.child.kill().unwrap();
    let killed = Instant::now();
    exporter.child.wait().unwrap();
    let limit = Duration::from_secs(deadline_secs + 5);
    let status = loop {
        if let Some(status) = puller.try_wait().unwrap() {
            break status;
        }
        assert!(
            killed.elapsed() < limit,
            "D still running {limit:?} after P died"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = killed.elapsed();
    let mut stdout = Vec::new();
    std::io::Read::read_to_end(puller.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    (status, reports(&stdout), elapsed)
}

#[test]
fn a_killed_exporter_fails_a_tcp_pull_within_its_deadline() {
    let deadline = 5;
    let (status, lines, elapsed) = kill_exporter_mid_transfer(TCP, deadline);
    assert!(!status.success(), "{lines:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["ok"], false);
    let error = lines[0]["error"].as_str().unwrap();
    assert!(
        error.contains("failed") || error.contains("deadline"),
        "{error}"
    );
    assert!(
        elapsed < Duration::from_secs(deadline + 2),
        "D failed {elapsed:?} after P died"
    );
}

#[test]
fn a_killed_exporter_never_hangs_or_corrupts_a_shared_memory_pull() {
    // One-sided: D maps P's segment, which outlives P, so the pull may well finish; it must end
    // by its deadline either way, and a success is the verified pattern.
    let deadline = 5;
    let (status, lines, elapsed) = kill_exporter_mid_transfer(SHM, deadline);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(status.success(), lines[0]["ok"] == true, "{lines:?}");
    assert!(elapsed < Duration::from_secs(deadline + 2), "{elapsed:?}");
}

/// Bytes valgrind reports for `kind` ("definitely lost", "still reachable"...) in `log`.
fn leaked(log: &str, kind: &str) -> u64 {
    let line = log
        .lines()
        .find(|l| l.contains(&format!("{kind}:")))
        .unwrap_or_else(|| panic!("no {kind:?} in the valgrind log:\n{log}"));
    let after = line.split(&format!("{kind}:")).nth(1).unwrap();
    after
        .split_whitespace()
        .next()
        .unwrap()
        .replace(',', "")
        .parse()
        .unwrap()
}

/// Runs `cycles` fresh connect/transfer/disconnect cycles with P and D both under valgrind;
/// returns D's "still reachable" bytes after checking that neither lost any.
fn cycles_under_valgrind(tls: &str, cycles: usize, dir: &std::path::Path) -> u64 {
    let valgrind = |log: &str| {
        strings(&[
            "valgrind",
            "--leak-check=full",
            "--show-leak-kinds=definite,indirect",
            &format!("--log-file={}", dir.join(log).display()),
        ])
    };
    let count = cycles.to_string();
    let exporter = Exporter::start(
        tls,
        &valgrind("p.log"),
        &strings(&[
            "--bytes",
            "1048576",
            "--count",
            &count,
            "--ahead",
            "1",
            "--pool-mib",
            "8",
        ]),
    );
    let output = pull_command(
        tls,
        &valgrind("d.log"),
        &exporter.addr,
        &strings(&[
            "--bytes",
            "1048576",
            "--count",
            &count,
            "--fresh",
            "--deadline",
            "60",
        ]),
    )
    .output()
    .expect("valgrind runs (apt-get install valgrind)");
    let lines = reports(&output.stdout);
    assert!(output.status.success(), "{lines:?}");
    assert_eq!(lines.len(), cycles);
    assert!(exporter.finish().success());
    for side in ["p.log", "d.log"] {
        let log = std::fs::read_to_string(dir.join(side)).unwrap();
        for kind in ["definitely lost", "indirectly lost"] {
            assert_eq!(leaked(&log, kind), 0, "{side}: {kind}\n{log}");
        }
    }
    leaked(
        &std::fs::read_to_string(dir.join("d.log")).unwrap(),
        "still reachable",
    )
}

#[test]
fn repeated_cycles_leak_nothing() {
    let dir = tempfile::tempdir().unwrap();
    for tls in [SHM, TCP] {
        let few = cycles_under_valgrind(tls, 2, dir.path());
        let many = cycles_under_valgrind(tls, 6, dir.path());
        // UCX keeps some global state for the life of the process; it must not grow per cycle.
        assert!(
            many <= few + 1024,
            "{tls}: still reachable grew from {few} to {many} bytes over 4 more cycles"
        );
    }
}
