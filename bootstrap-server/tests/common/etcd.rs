//! A real etcd for the tests: Debian's `etcd` binary on 127.0.0.1, free ports, a data folder
//! under the target directory. One is shared by every test of a test binary (each test uses its
//! own cluster name); tests that stop etcd start their own.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};

/// How long etcd may take to answer its health check after a start.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A running (or stopped) etcd member.
pub struct Etcd {
    client_port: u16,
    peer_port: u16,
    dir: PathBuf,
    child: Option<Child>,
    /// Killed by the kernel when the thread that started it ends (the shared member, whose
    /// owner never returns); other members are killed by `Drop`, also on a failed test.
    dies_with_thread: bool,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// A fresh data folder; folders left by test processes that have exited are removed (etcd
/// preallocates its log, so they are not small).
fn data_dir() -> PathBuf {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("etcd");
    std::fs::create_dir_all(&root).unwrap();
    for entry in std::fs::read_dir(&root).unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let owner = name.split('-').next().and_then(|p| p.parse().ok());
        if owner.is_some_and(|pid| !pid_alive(pid)) {
            let _ = std::fs::remove_dir_all(entry.path());
            let _ = std::fs::remove_file(entry.path());
        }
    }
    let dir = root.join(format!(
        "{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

impl Etcd {
    /// Starts a new member with an empty data folder and waits until it is healthy. It blocks:
    /// call it from `spawn_blocking` where servers run on the same runtime.
    pub fn start() -> Etcd {
        Self::start_with(false)
    }

    fn start_with(dies_with_thread: bool) -> Etcd {
        let mut etcd = Etcd {
            client_port: free_port(),
            peer_port: free_port(),
            dir: data_dir(),
            child: None,
            dies_with_thread,
        };
        etcd.resume();
        etcd
    }

    /// The `--store` value that reaches it.
    pub fn store_url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client_port)
    }

    /// Its `host:port`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// Starts the member again on the same ports and data (after [`Etcd::stop`]); blocks until it
    /// is healthy.
    pub fn resume(&mut self) {
        assert!(self.child.is_none(), "etcd is already running");
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log = std::fs::File::create(self.dir.with_extension("log")).unwrap();
        let mut command = Command::new("etcd");
        command
            .arg("--name=test")
            .arg(format!("--data-dir={}", self.dir.display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=test={peer}"))
            .stdout(Stdio::null())
            .stderr(log);
        if self.dies_with_thread {
            // SAFETY: prctl is async-signal-safe; it only asks the kernel to kill etcd when the
            // thread that started it ends, so the shared member does not outlive the tests.
            unsafe {
                command.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
        }
        let child = command
            .spawn()
            .expect("cannot start etcd: install Debian's etcd-server (see .ci/run)");
        self.child = Some(child);
        self.wait_healthy();
    }

    fn wait_healthy(&mut self) {
        let started = Instant::now();
        let health = "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!(
                        "etcd exited at start ({status}); log: {}",
                        self.dir.with_extension("log").display()
                    );
                }
            }
            if let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", self.client_port)) {
                use std::io::{Read, Write};
                let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
                let mut answer = String::new();
                if stream.write_all(health.as_bytes()).is_ok()
                    && stream.read_to_string(&mut answer).is_ok()
                    && answer.contains("\"health\":\"true\"")
                {
                    return;
                }
            }
            assert!(
                started.elapsed() < START_TIMEOUT,
                "etcd did not become healthy"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills the member (its data stays for [`Etcd::resume`]).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(self.dir.with_extension("log"));
    }
}

/// The member shared by every test of this test binary. It is started from a thread that lives
/// as long as the process, so it runs until the tests end.
pub fn shared() -> &'static str {
    static ENDPOINT: OnceLock<String> = OnceLock::new();
    ENDPOINT.get_or_init(|| {
        let (sender, receiver) = mpsc::channel();
        std::thread::spawn(move || {
            let etcd = Etcd::start_with(true);
            sender.send(etcd.endpoint()).unwrap();
            // Owning the member keeps it (and the death signal's parent thread) alive.
            loop {
                std::thread::park();
                let _ = &etcd;
            }
        });
        receiver.recv().expect("the shared etcd started")
    })
}

/// A cluster name no other test uses.
pub fn unique_cluster() -> String {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    format!(
        "t{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}
