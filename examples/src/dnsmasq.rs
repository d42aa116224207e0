//! A real DNS server for tests: Debian's `dnsmasq` on 127.0.0.1 and a free port, answering for
//! one local domain only (any other name under it is NXDOMAIN), its records a test's to change
//! (dnsmasq restarts on the same port with the new ones), its answers stoppable (SIGSTOP: the
//! server stops answering, as a DNS server under trouble does).

use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

/// The records served.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Records {
    /// SRV records: (name, target host, port).
    pub srv: Vec<(String, String, u16)>,
    /// A and AAAA records: (name, address).
    pub hosts: Vec<(String, IpAddr)>,
}

/// A running dnsmasq.
pub struct Dnsmasq {
    /// Where it answers (UDP and TCP).
    pub addr: SocketAddr,
    domain: String,
    dir: PathBuf,
    child: Child,
}

impl Dnsmasq {
    /// Starts dnsmasq answering for `domain` (e.g. `pd.test`) with `records`, its files in
    /// `dir`; records live 1 s.
    pub async fn start(dir: &Path, domain: &str, records: &Records) -> std::io::Result<Self> {
        let addr = free_port()?;
        let child = spawn(dir, addr, domain, records).await?;
        Ok(Dnsmasq {
            addr,
            domain: domain.to_owned(),
            dir: dir.to_owned(),
            child,
        })
    }

    /// Serves `records` from now on (dnsmasq restarted on the same port: a query meanwhile
    /// may go unanswered, as during a DNS server's restart).
    pub async fn set(&mut self, records: &Records) -> std::io::Result<()> {
        self.child.kill().await?;
        self.child = spawn(&self.dir, self.addr, &self.domain, records).await?;
        Ok(())
    }

    /// Stops answering (SIGSTOP) or answers again (SIGCONT).
    pub fn pause(&self, paused: bool) {
        if let Some(pid) = self.child.id() {
            let signal = if paused { libc::SIGSTOP } else { libc::SIGCONT };
            // SAFETY: kill(2) with a valid signal has no memory effects.
            unsafe { libc::kill(pid as i32, signal) };
        }
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        self.pause(false);
        let _ = self.child.start_kill();
    }
}

/// A port free for both UDP and TCP on 127.0.0.1.
fn free_port() -> std::io::Result<SocketAddr> {
    for _ in 0..50 {
        let udp = UdpSocket::bind("127.0.0.1:0")?;
        let addr = udp.local_addr()?;
        if std::net::TcpListener::bind(addr).is_ok() {
            return Ok(addr);
        }
    }
    Err(std::io::Error::other("no port free for both UDP and TCP"))
}

async fn spawn(
    dir: &Path,
    addr: SocketAddr,
    domain: &str,
    records: &Records,
) -> std::io::Result<Child> {
    let mut conf = format!(
        "port={}\nlisten-address=127.0.0.1\nbind-interfaces\nno-resolv\nno-hosts\n\
         local=/{domain}/\nlocal-ttl=1\n",
        addr.port()
    );
    for (name, target, port) in &records.srv {
        let _ = writeln!(conf, "srv-host={name},{target},{port}");
    }
    for (name, ip) in &records.hosts {
        let _ = writeln!(conf, "host-record={name},{ip}");
    }
    let file = dir.join("dnsmasq.conf");
    std::fs::write(&file, conf)?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("dnsmasq.log"))?;
    let mut child = Command::new(which_dnsmasq())
        .arg("--keep-in-foreground")
        .arg(format!("--conf-file={}", file.display()))
        .arg(format!("--pid-file={}", dir.join("dnsmasq.pid").display()))
        .arg("--user=root")
        .arg("--log-facility=-")
        .stdout(log.try_clone()?)
        .stderr(log)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err() {
        if let Some(status) = child.try_wait()? {
            return Err(std::io::Error::other(format!(
                "dnsmasq exited ({status}); see {}",
                dir.join("dnsmasq.log").display()
            )));
        }
        if Instant::now() > deadline {
            return Err(std::io::Error::other("dnsmasq did not start listening"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(child)
}

/// dnsmasq's path: Debian installs it in /usr/sbin, which a user's PATH may lack.
fn which_dnsmasq() -> PathBuf {
    let sbin = PathBuf::from("/usr/sbin/dnsmasq");
    if sbin.exists() {
        sbin
    } else {
        PathBuf::from("dnsmasq")
    }
}
