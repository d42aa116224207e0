//! A closed-loop HTTP load generator: N connections, each sending its next request as soon as
//! the previous answer has been read in full, for a fixed time. Built on raw hyper HTTP/1.1
//! connections so that the generator costs as little CPU as possible on the machine it shares
//! with the server under test.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;

/// Builds the `n`-th request of a run (so that ids can be unique per call).
pub type RequestFactory = Arc<dyn Fn(u64) -> Request<Full<Bytes>> + Send + Sync>;

/// How hard and how long to push.
#[derive(Debug, Clone, Copy)]
pub struct LoadConfig {
    /// Concurrent connections, each with one request in flight.
    pub concurrency: usize,
    /// How long to measure.
    pub duration: Duration,
    /// Time to run before measuring (connections warm, caches filled).
    pub warmup: Duration,
    /// Record the time to the first body bytes instead of the time to the whole answer.
    pub first_byte: bool,
}

/// What a run measured.
#[derive(Debug, Clone)]
pub struct LoadReport {
    /// Answers with a 2xx status inside the measured window.
    pub ok: u64,
    /// Non-2xx answers and transport errors inside the measured window.
    pub errors: u64,
    /// The measured window.
    pub elapsed: Duration,
    /// Latency of successful requests, in microseconds.
    pub latency_us: Histogram<u64>,
}

impl LoadReport {
    /// Successful requests per second.
    pub fn rps(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64()
    }

    /// A latency quantile (0.5, 0.99, 0.999) in milliseconds.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        self.latency_us.value_at_quantile(q) as f64 / 1000.0
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid histogram bounds")
}

struct WorkerResult {
    ok: u64,
    errors: u64,
    latency_us: Histogram<u64>,
}

/// TLS for the load's connections: whom they trust, and the name they ask for.
#[derive(Clone)]
pub struct ClientTls {
    connector: tokio_rustls::TlsConnector,
    name: rustls::pki_types::ServerName<'static>,
}

impl ClientTls {
    /// Connections trusting only the CA certificates in `ca` (PEM), asking for `localhost`,
    /// HTTP/1.1 (no ALPN): the same exchanges as over plain TCP.
    pub fn trusting(ca: &std::path::Path) -> Result<Self, String> {
        let roots = pd_service::tls::read_roots(ca).map_err(|e| e.to_string())?;
        let config = rustls::ClientConfig::builder_with_provider(pd_service::tls::crypto())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(ClientTls {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            name: rustls::pki_types::ServerName::try_from("localhost").expect("a valid name"),
        })
    }
}

async fn connect(addr: SocketAddr, tls: Option<&ClientTls>) -> Option<Connection> {
    let stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream.set_nodelay(true).ok()?;
    let Some(tls) = tls else {
        return handshake(stream).await;
    };
    let stream = tls.connector.connect(tls.name.clone(), stream).await.ok()?;
    handshake(stream).await
}

async fn handshake<I>(io: I) -> Option<Connection>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .ok()?;
    tokio::spawn(connection);
    Some(sender)
}

type Connection = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

/// Sends one request and reads the whole answer: `Some((true, first_byte))` for a 2xx,
/// `Some((false, _))` for another status, `None` when the connection failed. `first_byte` is
/// when the first body bytes arrived.
async fn send(conn: &mut Connection, request: Request<Full<Bytes>>) -> Option<(bool, Instant)> {
    conn.ready().await.ok()?;
    let response = conn.send_request(request).await.ok()?;
    let status = response.status();
    let mut body = response.into_body();
    let mut first_byte = None;
    while let Some(frame) = body.frame().await {
        frame.ok()?;
        first_byte.get_or_insert_with(Instant::now);
    }
    Some((status.is_success(), first_byte.unwrap_or_else(Instant::now)))
}

#[allow(clippy::too_many_arguments)]
async fn worker(
    addr: SocketAddr,
    tls: Option<ClientTls>,
    make: RequestFactory,
    first: u64,
    stride: u64,
    measure_from: Instant,
    stop_at: Instant,
    first_byte_only: bool,
) -> WorkerResult {
    let mut result = WorkerResult {
        ok: 0,
        errors: 0,
        latency_us: histogram(),
    };
    let mut sender = None;
    let mut seq = first;
    while Instant::now() < stop_at {
        let Some(conn) = sender.as_mut() else {
            sender = connect(addr, tls.as_ref()).await;
            if sender.is_none() {
                result.errors += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            continue;
        };
        let request = make(seq);
        seq += stride;
        let started = Instant::now();
        let outcome = send(conn, request).await;
        let measured = started >= measure_from;
        match outcome {
            Some((true, first_byte)) => {
                if measured {
                    result.ok += 1;
                    let end = if first_byte_only {
                        first_byte
                    } else {
                        Instant::now()
                    };
                    let us = end.duration_since(started).as_micros().max(1) as u64;
                    let _ = result.latency_us.record(us.min(60_000_000));
                }
            }
            Some((false, _)) => result.errors += u64::from(measured),
            None => {
                result.errors += u64::from(measured);
                sender = None;
            }
        }
    }
    result
}

/// Runs `config.concurrency` closed loops against `addr` and merges what they measured.
pub async fn run(addr: SocketAddr, make: RequestFactory, config: LoadConfig) -> LoadReport {
    run_over(addr, None, make, config).await
}

/// [`run`], over TLS when `tls` is given.
pub async fn run_over(
    addr: SocketAddr,
    tls: Option<ClientTls>,
    make: RequestFactory,
    config: LoadConfig,
) -> LoadReport {
    let measure_from = Instant::now() + config.warmup;
    let stop_at = measure_from + config.duration;
    let workers: Vec<_> = (0..config.concurrency)
        .map(|i| {
            tokio::spawn(worker(
                addr,
                tls.clone(),
                make.clone(),
                i as u64,
                config.concurrency as u64,
                measure_from,
                stop_at,
                config.first_byte,
            ))
        })
        .collect();
    let mut report = LoadReport {
        ok: 0,
        errors: 0,
        elapsed: config.duration,
        latency_us: histogram(),
    };
    for handle in workers {
        if let Ok(result) = handle.await {
            report.ok += result.ok;
            report.errors += result.errors;
            let _ = report.latency_us.add(&result.latency_us);
        }
    }
    report
}

/// Sends requests `0..count` over `concurrency` connections as fast as they are answered (to
/// fill a server with state); returns how many succeeded and failed.
pub async fn run_count(
    addr: SocketAddr,
    make: RequestFactory,
    count: u64,
    concurrency: usize,
) -> LoadReport {
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (make, next) = (make.clone(), next.clone());
            tokio::spawn(async move {
                let mut result = WorkerResult {
                    ok: 0,
                    errors: 0,
                    latency_us: histogram(),
                };
                let mut conn = None;
                loop {
                    let seq = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if seq >= count {
                        break result;
                    }
                    if conn.is_none() {
                        conn = connect(addr, None).await;
                    }
                    let outcome = match conn.as_mut() {
                        Some(c) => send(c, make(seq)).await,
                        None => None,
                    };
                    match outcome {
                        Some((true, _)) => result.ok += 1,
                        Some((false, _)) => result.errors += 1,
                        None => {
                            result.errors += 1;
                            conn = None;
                        }
                    }
                }
            })
        })
        .collect();
    let mut report = LoadReport {
        ok: 0,
        errors: 0,
        elapsed: Duration::ZERO,
        latency_us: histogram(),
    };
    for handle in workers {
        if let Ok(result) = handle.await {
            report.ok += result.ok;
            report.errors += result.errors;
        }
    }
    report.elapsed = started.elapsed();
    report
}

/// A JSON POST request to `path`.
pub fn post_json(host: &str, path: &str, body: Vec<u8>) -> Request<Full<Bytes>> {
    json_request(hyper::Method::POST, host, path, body)
}

/// A JSON request with `method` to `path`.
pub fn json_request(
    method: hyper::Method,
    host: &str,
    path: &str,
    body: Vec<u8>,
) -> Request<Full<Bytes>> {
    Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, host)
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("a valid request")
}

/// A GET request to `path`.
pub fn get(host: &str, path: &str) -> Request<Full<Bytes>> {
    Request::get(path)
        .header(hyper::header::HOST, host)
        .body(Full::new(Bytes::new()))
        .expect("a valid request")
}

/// Raises this process's limit of open files (and so its children's) to the hard limit: every
/// client in flight holds a socket, and each system under test opens more for its backends.
pub fn raise_open_files_limit() -> std::io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the one struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        limit.rlim_cur = limit.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(limit.rlim_cur)
}

/// CPU time and peak memory of a process, read from `/proc`.
#[derive(Debug, Clone, Copy)]
pub struct ProcessUsage {
    /// User plus system CPU time so far.
    pub cpu: Duration,
    /// The system (kernel) part of `cpu`: system calls, and the TCP traffic they carry.
    pub kernel: Duration,
    /// Peak resident set size (VmHWM), in bytes.
    pub peak_rss: u64,
    /// Current resident set size (VmRSS), in bytes.
    pub rss: u64,
    /// Context switches of its live threads so far ...
    pub switches: u64,
    /// ... of which voluntary: a thread gave up its CPU to wait (for a socket, a lock, work)
    /// and had to be woken again.
    pub wakeups: u64,
}

impl ProcessUsage {
    /// Reads the usage of process `pid`.
    pub fn read(pid: u32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
        let after_name = &stat[stat.rfind(')')? + 2..];
        let fields: Vec<&str> = after_name.split_whitespace().collect();
        let user_ticks: u64 = fields.get(11)?.parse().ok()?;
        let kernel_ticks: u64 = fields.get(12)?.parse().ok()?;
        // SAFETY: sysconf has no memory effects.
        let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let seconds = |ticks: u64| Duration::from_secs_f64(ticks as f64 / per_second);
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let kb = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024
        };
        let (voluntary, involuntary) = thread_switches(pid);
        Some(ProcessUsage {
            cpu: seconds(user_ticks + kernel_ticks),
            kernel: seconds(kernel_ticks),
            peak_rss: kb("VmHWM:"),
            rss: kb("VmRSS:"),
            switches: voluntary + involuntary,
            wakeups: voluntary,
        })
    }
}

/// The voluntary and involuntary context switches of every live thread of `pid`, from each
/// thread's `/proc/PID/task/TID/status` (the process's own status counts its first thread only).
fn thread_switches(pid: u32) -> (u64, u64) {
    let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return (0, 0);
    };
    let count = |status: &str, key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    threads
        .flatten()
        .filter_map(|thread| std::fs::read_to_string(thread.path().join("status")).ok())
        .fold((0, 0), |(voluntary, involuntary), status| {
            (
                voluntary + count(&status, "voluntary_ctxt_switches:"),
                involuntary + count(&status, "nonvoluntary_ctxt_switches:"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn measures_a_local_server() {
        let app = axum::Router::new().route("/x", axum::routing::get(|| async { "ok" }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let host = addr.to_string();
        let make: RequestFactory = Arc::new(move |_| get(&host, "/x"));
        let config = LoadConfig {
            concurrency: 4,
            duration: Duration::from_millis(300),
            warmup: Duration::from_millis(50),
            first_byte: false,
        };
        let report = run(addr, make, config).await;
        assert!(report.ok > 10, "{report:?}");
        assert_eq!(report.errors, 0);
        assert!(report.quantile_ms(0.5) > 0.0);
        let usage = ProcessUsage::read(std::process::id()).unwrap();
        assert!(usage.peak_rss > 0 && usage.cpu > Duration::ZERO);
        // 300 ms of HTTP over loopback spends some of its time in system calls.
        assert!(usage.kernel > Duration::ZERO && usage.kernel < usage.cpu);
        // The runtime's threads waited for the sockets, and were woken.
        assert!(
            usage.wakeups > 0 && usage.switches >= usage.wakeups,
            "{usage:?}"
        );
    }
}
