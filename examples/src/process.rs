//! Starting and stopping the cluster's processes: each logs to a file of the run folder, dies
//! with the launcher, answers `/health` before it counts as started; and the ports they take.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use worker_client::ClientTls;

use tokio::process::{Child, Command};

use crate::cluster::ClusterError;

/// One started process.
pub struct Process {
    /// A short name (`bootstrap-0`, `prefill-1`, `proxy`...).
    pub name: String,
    /// Its base URL (a registrar's: the bootstrap server it registers with).
    pub url: String,
    /// Its log file.
    pub log: PathBuf,
    /// How long [`Cluster::shutdown`](crate::cluster::Cluster::shutdown) waits after SIGTERM
    /// before SIGKILL (1 s unless the starter chose otherwise: vLLM takes longer).
    pub stop_grace: Duration,
    /// What a caller trusts and presents to it (an `https://` server of a cluster with TLS).
    pub client_tls: ClientTls,
    /// Its process group (it leads one of its own).
    group: i32,
    child: Child,
}

impl Process {
    /// Sends SIGTERM, waits up to `grace`, then SIGKILL; then SIGKILL to whatever is left of
    /// its process group (the processes it started itself, such as vLLM's engine core).
    pub async fn stop(&mut self, grace: Duration) {
        if self.child.id().is_some() {
            self.signal_group(libc::SIGTERM);
            let _ = tokio::time::timeout(grace, self.child.wait()).await;
        }
        self.kill().await;
    }

    /// The operating system's process id (None once it has been reaped).
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// SIGKILL at once (a crash), to the process and its process group.
    pub async fn kill(&mut self) {
        self.signal_group(libc::SIGKILL);
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// Freezes every process of its group (SIGSTOP: a hung engine that still holds its
    /// connections), or lets it run on (`false`: SIGCONT).
    pub fn freeze(&self, frozen: bool) {
        self.signal_group(if frozen { libc::SIGSTOP } else { libc::SIGCONT });
    }

    /// Whether it has exited (and how).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Whether it has exited, or was killed and reaped already ([`Process::kill`]).
    pub fn exited_or_reaped(&mut self) -> bool {
        self.pid().is_none() || self.exited().is_some()
    }

    /// Sends `signal` to every process of its group: itself and what it started (vLLM's
    /// engine core and workers). A group's id stays reserved while any member lives, so this
    /// reaches no other process.
    fn signal_group(&self, signal: i32) {
        // SAFETY: kill(2) with a valid signal has no memory effects.
        unsafe { libc::kill(-self.group, signal) };
    }

    /// The last `lines` lines of its log (lossy UTF-8).
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read(&self.log).unwrap_or_default();
        tail(&String::from_utf8_lossy(&text), lines)
    }
}

impl Drop for Process {
    /// A process dropped while running is killed with its whole group (`kill_on_drop` alone
    /// would leave vLLM's engine core behind).
    fn drop(&mut self) {
        if self.child.id().is_some() {
            self.signal_group(libc::SIGKILL);
        }
    }
}

/// The last `lines` lines of `text`.
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Fails when `port` cannot be bound on 127.0.0.1 (`flag` chooses another).
pub(crate) fn ensure_free(port: u16, flag: &'static str) -> Result<(), ClusterError> {
    TcpListener::bind(("127.0.0.1", port))
        .map(drop)
        .map_err(|_| ClusterError::PortBusy { port, flag })
}

/// The ports of the processes: consecutive ones from `--base-port`, each checked free, or free
/// ephemeral ones.
pub(crate) struct Ports {
    /// The next port to take, when consecutive ports were asked for.
    pub(crate) next: Option<u16>,
}

impl Ports {
    pub(crate) fn take(&mut self) -> Result<u16, ClusterError> {
        let Some(port) = self.next else {
            return Ok(free_port());
        };
        ensure_free(port, "--base-port")?;
        self.next = Some(port.checked_add(1).ok_or(ClusterError::PortBusy {
            port,
            flag: "--base-port",
        })?);
        Ok(port)
    }
}

impl Ports {
    /// `n` consecutive ports (an engine's per-dp-rank sockets are offset from one).
    pub(crate) fn take_run(&mut self, n: u16) -> Result<u16, ClusterError> {
        if self.next.is_some() {
            let first = self.take()?;
            for _ in 1..n {
                self.take()?;
            }
            return Ok(first);
        }
        Ok(free_ports(n))
    }
}

/// A port that was free a moment ago, below the kernel's ephemeral range and never handed out
/// before by this process.
///
/// The processes bind their ports a while after they are chosen (a vLLM engine only once its
/// model is loaded). Ports the kernel hands to `bind(0)` meanwhile (the engines' own sockets)
/// come from the ephemeral range (32768 and up by default), so choosing below it means only a
/// port this process chose could collide, and those are remembered.
pub fn free_port() -> u16 {
    free_ports(1)
}

/// The first of `n` consecutive ports chosen as [`free_port`] chooses one.
pub fn free_ports(n: u16) -> u16 {
    use std::collections::HashSet;
    use std::hash::BuildHasher;
    use std::sync::Mutex;
    static GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);
    let random = std::collections::hash_map::RandomState::new();
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let given = given.get_or_insert_with(HashSet::new);
    for attempt in 0u64.. {
        let first = 20_000 + (random.hash_one(attempt) % 12_000) as u16;
        let ports = first..first + n.max(1);
        let free =
            |port: u16| !given.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok();
        if ports.clone().all(free) {
            given.extend(ports);
            return first;
        }
    }
    unreachable!("an endless search ends with a port")
}

/// Starts `program` with `args`, logging to `<run_dir>/<name>.log`; `url` is its base URL.
pub fn spawn(
    run_dir: &Path,
    name: &str,
    program: &Path,
    args: &[String],
    url: String,
) -> Result<Process, ClusterError> {
    spawn_with_env(run_dir, name, program, args, &[], url)
}

/// [`spawn`] with extra environment variables.
pub fn spawn_with_env(
    run_dir: &Path,
    name: &str,
    program: &Path,
    args: &[String],
    env: &[(&str, &str)],
    url: String,
) -> Result<Process, ClusterError> {
    let log = run_dir.join(format!("{name}.log"));
    let file = std::fs::File::create(&log).map_err(|source| ClusterError::RunDir {
        path: log.clone(),
        source,
    })?;
    let stderr = file.try_clone().map_err(|source| ClusterError::RunDir {
        path: log.clone(),
        source,
    })?;
    let mut command = Command::new(program);
    let cpus = crate::cpus::child_cpus();
    // SAFETY: the hook runs in the child between fork and exec and only calls async-signal-safe
    // functions (prctl, getppid, _exit, sched_setaffinity).
    unsafe {
        command.pre_exec(move || {
            // The child dies with the launcher, also when it is killed with SIGKILL.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() == 1 {
                // The launcher died before the line above: do not outlive it.
                libc::_exit(1);
            }
            if let Some(cpus) = cpus {
                crate::cpus::set_affinity(cpus)?;
            }
            Ok(())
        });
    }
    let child = command
        .args(args)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(stderr)
        .kill_on_drop(true)
        .process_group(0)
        .spawn()
        .map_err(|source| ClusterError::Spawn {
            name: name.to_owned(),
            source,
        })?;
    let group = child.id().map_or(0, |pid| pid as i32);
    Ok(Process {
        name: name.to_owned(),
        url,
        log,
        stop_grace: Duration::from_secs(1),
        client_tls: ClientTls::default(),
        group,
        child,
    })
}

/// How many of a process's last log lines a start-up failure shows.
const LOG_TAIL_LINES: usize = 25;

/// Polls `path` of the process until it answers 200, the process exits, or `timeout` passes.
pub async fn wait_for(
    process: &mut Process,
    path: &str,
    timeout: Duration,
) -> Result<(), ClusterError> {
    let http = (process.client_tls.apply(reqwest::Client::builder()))
        .timeout(Duration::from_secs(2))
        .build()
        .expect("an HTTP client of loaded certificates builds");
    let url = format!("{}{path}", process.url);
    let started = Instant::now();
    while started.elapsed() < timeout {
        if let Ok(Some(status)) = process.child.try_wait() {
            return Err(ClusterError::Exited {
                name: process.name.clone(),
                status,
                log: process.log.display().to_string(),
                tail: process.log_tail(LOG_TAIL_LINES),
            });
        }
        if let Ok(response) = http.get(&url).send().await {
            if response.status().is_success() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(ClusterError::NotReady {
        name: process.name.clone(),
        url,
        timeout,
        log: process.log.display().to_string(),
        tail: process.log_tail(LOG_TAIL_LINES),
    })
}
