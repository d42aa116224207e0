//! Serving on every core without handing requests between cores.
//!
//! A multi-threaded runtime lets any of its threads poll any task: a request's three
//! exchanges (the client's, P's, D's) are woken on whichever thread the socket's readiness
//! reached, idle threads are woken to steal work, and every wake-up and every poll touches
//! shared queues. The more cores, the more each request pays for that.
//!
//! [`serve_on_cores`] runs one single-threaded runtime per serving thread instead, each
//! accepting on a listener of its own. The listeners share the port (`SO_REUSEPORT`, see
//! [`bind_shared`]): the kernel spreads new connections across them. A connection, its
//! requests and whatever they spawn then live on the thread that accepted it; calls to
//! backends stay there too when their connection pools are kept per thread ([`current_core`]
//! says which). The control plane (discovery, health checks, reloads, the operator's
//! listener) stays on the runtime that called [`serve_on_cores`].

use std::cell::Cell;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{oneshot, watch, Semaphore};

use crate::serve::{serve_with_slots, BindError, ServeLimits};

/// Connections waiting to be accepted, per listener.
const LISTEN_BACKLOG: u32 = 1024;

thread_local! {
    /// The serving thread this is (see [`current_core`]).
    static CORE: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The serving thread of [`serve_on_cores`] the caller runs on (`0..threads`), or `None` on
/// any other thread: what keeps per-thread state (connection pools) apart.
pub fn current_core() -> Option<usize> {
    CORE.get()
}

/// The number of serving threads `requested` asks for: itself, or for 0 one per CPU this
/// process may run on (its affinity mask, a container's CPU limit).
pub fn serving_threads(requested: usize) -> usize {
    match requested {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// Binds `count` (at least one) listeners on `host:port` sharing the port with
/// `SO_REUSEPORT`; with port 0 the first one picks a free port and the others take it. A port
/// another socket listens on is an error, as for a plain bind (`SO_REUSEPORT` would otherwise
/// let a second proxy of the same user share it silently). Each address `host` resolves to is
/// tried in turn.
pub async fn bind_shared(
    host: &str,
    port: u16,
    count: usize,
) -> Result<Vec<TcpListener>, BindError> {
    let failed = |source: std::io::Error| BindError {
        addr: if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        },
        source,
    };
    let mut last = std::io::Error::other("the host name has no address");
    for addr in tokio::net::lookup_host((host, port))
        .await
        .map_err(failed)?
    {
        match bind_group(addr, count.max(1)) {
            Ok(listeners) => return Ok(listeners),
            Err(err) => last = err,
        }
    }
    Err(failed(last))
}

/// `count` listeners sharing `addr`'s port, which no other socket may be listening on.
fn bind_group(mut addr: SocketAddr, count: usize) -> std::io::Result<Vec<TcpListener>> {
    if addr.port() != 0 {
        // A plain bind fails where another socket listens, SO_REUSEPORT or not.
        drop(std::net::TcpListener::bind(addr)?);
    }
    let mut listeners = Vec::with_capacity(count);
    for _ in 0..count {
        let listener = listen_reusing_port(addr)?;
        addr = listener.local_addr()?;
        listeners.push(listener);
    }
    Ok(listeners)
}

fn listen_reusing_port(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Serves `app` on each of `listeners` (from [`bind_shared`]) on a thread and a
/// single-threaded runtime of its own, with the limits of [`crate::serve`]; the connection cap
/// is shared by all. When `shutdown` resolves every thread stops accepting and lets its
/// requests finish within the grace; returns once all have.
pub async fn serve_on_cores(
    listeners: Vec<TcpListener>,
    app: Router,
    shutdown: impl Future<Output = ()>,
    limits: ServeLimits,
) -> std::io::Result<()> {
    let (stop, stopped) = watch::channel(false);
    let slots = (limits.max_connections).map(|n| Arc::new(Semaphore::new(n.max(1))));
    let mut threads = Vec::with_capacity(listeners.len());
    for (core, listener) in listeners.into_iter().enumerate() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        // Moved to the thread's runtime: its readiness is then polled there.
        let listener = {
            let _in_runtime = runtime.enter();
            TcpListener::from_std(listener.into_std()?)?
        };
        let (app, limits, slots) = (app.clone(), limits.clone(), slots.clone());
        let mut stopped = stopped.clone();
        let (done, finished) = oneshot::channel();
        std::thread::Builder::new()
            .name(format!("pd-serve-{core}"))
            .spawn(move || {
                CORE.set(Some(core));
                let shutdown = async move {
                    // The sender lives until every thread is told: waiting cannot fail.
                    let _ = stopped.wait_for(|stop| *stop).await;
                };
                let served =
                    runtime.block_on(serve_with_slots(listener, app, shutdown, limits, slots));
                let _ = done.send(served);
            })?;
        threads.push(finished);
    }
    shutdown.await;
    let _ = stop.send(true);
    let mut result = Ok(());
    for finished in threads {
        let served = finished
            .await
            .unwrap_or_else(|_| Err(std::io::Error::other("a serving thread panicked")));
        result = result.and(served);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::time::Duration;

    /// The serving thread that answers, by name.
    fn app() -> Router {
        Router::new().route(
            "/",
            axum::routing::get(|| async {
                let core = current_core().map_or("none".to_owned(), |c| c.to_string());
                // A task spawned by the request runs on the same thread.
                let spawned = tokio::spawn(async { current_core() }).await.unwrap();
                assert_eq!(spawned, current_core());
                core
            }),
        )
    }

    #[tokio::test]
    async fn connections_are_spread_over_the_threads_and_served_on_the_one_that_accepted() {
        let listeners = bind_shared("127.0.0.1", 0, 3).await.unwrap();
        let addr = listeners[0].local_addr().unwrap();
        assert!(listeners.iter().all(|l| l.local_addr().unwrap() == addr));
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(serve_on_cores(
            listeners,
            app(),
            async move {
                let _ = stopped.await;
            },
            ServeLimits::default(),
        ));
        let mut cores = HashSet::new();
        for _ in 0..60 {
            // A fresh connection each time: the kernel picks its listener.
            let client = reqwest::Client::new();
            let core = client
                .get(format!("http://{addr}/"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            cores.insert(core);
        }
        assert!(cores.len() >= 2, "one thread served all: {cores:?}");
        assert!(cores.iter().all(|c| ["0", "1", "2"].contains(&c.as_str())));
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("every thread stopped")
            .unwrap()
            .unwrap();
        assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    }

    #[tokio::test]
    async fn the_connection_cap_is_shared_by_the_threads() {
        let listeners = bind_shared("127.0.0.1", 0, 2).await.unwrap();
        let addr = listeners[0].local_addr().unwrap();
        let limits = ServeLimits {
            max_connections: Some(1),
            ..ServeLimits::default()
        };
        let (_stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(serve_on_cores(
            listeners,
            app(),
            async move {
                let _ = stopped.await;
            },
            limits,
        ));
        let first = reqwest::Client::new();
        let answer = first.get(format!("http://{addr}/")).send().await.unwrap();
        assert_eq!(answer.status(), 200);
        // The first client keeps its connection: a second one waits, whichever thread took
        // it, until the first is gone.
        let second = reqwest::Client::new();
        let waiting = second.get(format!("http://{addr}/")).send();
        let waited = tokio::time::timeout(Duration::from_millis(400), waiting).await;
        assert!(
            waited.is_err(),
            "a second connection was served: {waited:?}"
        );
        drop(first);
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            second.get(format!("http://{addr}/")).send(),
        )
        .await
        .expect("served once the first connection closed")
        .unwrap();
        assert_eq!(answer.status(), 200);
    }

    #[tokio::test]
    async fn a_port_someone_listens_on_is_refused() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let err = bind_shared("127.0.0.1", port, 2).await.unwrap_err();
        assert_eq!(err.source.kind(), std::io::ErrorKind::AddrInUse, "{err}");
        // So is a port another reuse-port group listens on.
        let group = bind_shared("127.0.0.1", 0, 2).await.unwrap();
        let port = group[0].local_addr().unwrap().port();
        let err = bind_shared("127.0.0.1", port, 2).await.unwrap_err();
        assert_eq!(err.source.kind(), std::io::ErrorKind::AddrInUse, "{err}");
        // "localhost" may resolve to ::1 first; some address of it binds.
        assert_eq!(bind_shared("localhost", 0, 2).await.unwrap().len(), 2);
    }

    #[test]
    fn zero_threads_means_one_per_cpu() {
        assert_eq!(serving_threads(3), 3);
        assert_eq!(
            serving_threads(0),
            std::thread::available_parallelism().unwrap().get()
        );
    }
}
