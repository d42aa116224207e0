//! Serving an axum router with the limits a long-running server needs.
//!
//! `axum::serve` reads request headers without a time limit (a client that connects and sends
//! nothing keeps its connection, and a file descriptor, forever) and its graceful shutdown waits
//! for every connection however long it streams. [`serve`] is the same accept loop with a header
//! read timeout, `TCP_NODELAY` on every connection, and a bounded grace period at shutdown (after
//! the not-ready delay of a [`Draining`] server, when it has one).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::TokioTimer;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch, Semaphore};
use tokio::task::JoinHandle;

use crate::connection::Connection;
use crate::draining::Draining;
use crate::tls::ServerTls;
use crate::wire_errors::WireErrorBody;

/// The listening socket could not be bound.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr}: {source}")]
pub struct BindError {
    /// The address asked for.
    pub addr: String,
    /// What failed.
    pub source: std::io::Error,
}

/// Binds a listener on `addr` (`host:port`; port 0 picks a free one).
pub async fn bind(host: &str, port: u16) -> Result<TcpListener, BindError> {
    TcpListener::bind((host, port))
        .await
        .map_err(|source| BindError {
            addr: if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            },
            source,
        })
}

/// A server running on a background task of the current runtime, stopped gracefully by
/// [`Background::shutdown`]. Tests and embedders start servers this way.
pub struct Background<E> {
    addr: SocketAddr,
    /// Whether it serves HTTPS (its URL's scheme).
    tls: bool,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), E>>,
}

impl<E: From<std::io::Error> + Send + 'static> Background<E> {
    /// Spawns `run`, listening on `addr`, with the future that tells it to shut down.
    pub fn spawn<R, F>(addr: SocketAddr, run: R) -> Self
    where
        R: FnOnce(std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> F,
        F: Future<Output = Result<(), E>> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(run(Box::pin(async move {
            let _ = stopped.await;
        })));
        Background {
            addr,
            tls: false,
            stop: Some(stop),
            task,
        }
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The same server, said to serve HTTPS when `tls` (its [`url`](Background::url)).
    pub fn over_tls(mut self, tls: bool) -> Self {
        self.tls = tls;
        self
    }

    /// `http://ADDR` (or `https://ADDR`), the base URL clients use.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Shuts the server down gracefully and waits until it has stopped.
    pub async fn shutdown(mut self) -> Result<(), E> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.task).await {
            Ok(result) => result,
            Err(join_error) => Err(E::from(std::io::Error::other(join_error))),
        }
    }
}

/// The most bytes hyper buffers per connection (a request's headers must fit in it).
const MAX_CONNECTION_BUFFER: usize = 128 * 1024;

/// Time limits and shutdown of [`serve`].
#[derive(Debug, Clone)]
pub struct ServeLimits {
    /// How long a connection may take to send a request's headers (also while idle between
    /// keep-alive requests) before it is closed.
    pub header_read_timeout: Duration,
    /// How long in-flight requests may run on after shutdown begins before their connections
    /// are closed.
    pub shutdown_grace: Duration,
    /// The JSON body of the errors hyper answers by itself (400 malformed request, 414, 431);
    /// `None` leaves them bodiless.
    pub wire_error_body: Option<WireErrorBody>,
    /// The most connections open at once; the next one accepted waits until one closes, the
    /// others in the listen backlog. `None`: no cap.
    pub max_connections: Option<usize>,
    /// Whether a handler may take its connection over (answer `101 Switching Protocols` and
    /// use `hyper::upgrade::on`). hyper-util's graceful shutdown knows no upgradeable
    /// connection, so such a server's connections are not drained at shutdown: for servers
    /// that run until their process ends (the TCP KV exporter).
    pub upgrades: bool,
    /// The server's [`Draining`] state, shared with its readiness routes and long polls:
    /// while it drains every answer carries `Connection: close`, so that clients holding
    /// keep-alive connections reconnect (to another replica, once the load balancer took this
    /// one out) instead of having the connection closed under them at the end of the delay; and
    /// it turns to stopping when the `shutdown` future resolves. `None`: the server has none.
    pub draining: Option<Draining>,
    /// TLS on every connection (see [`ServerTls`]): the handshake must end within the header
    /// read timeout, ALPN chooses HTTP/2 or HTTP/1.1, and a client speaking plain HTTP gets a
    /// 400 saying so. `None`: plain HTTP/1.1.
    pub tls: Option<ServerTls>,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            header_read_timeout: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(30),
            wire_error_body: None,
            max_connections: None,
            upgrades: false,
            draining: None,
            tls: None,
        }
    }
}

/// Serves `app` on `listener` over HTTP/1.1 until `shutdown` resolves; then stops accepting,
/// lets in-flight requests finish for at most `limits.shutdown_grace`, and returns.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()>,
    limits: ServeLimits,
) -> std::io::Result<()> {
    let slots = (limits.max_connections).map(|n| Arc::new(Semaphore::new(n.max(1))));
    serve_with_slots(listener, app, shutdown, limits, slots).await
}

/// [`serve`] with the connection cap's `slots`, which several listeners may share: a
/// connection is accepted, then waits for a slot before it is served (so a slot freed on one
/// listener never waits for a connection queued on another).
pub(crate) async fn serve_with_slots(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()>,
    limits: ServeLimits,
    slots: Option<Arc<Semaphore>>,
) -> std::io::Result<()> {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        // What a connection may buffer before the handler reads it (headers must fit): bounds
        // the memory of many slow clients.
        .max_buf_size(MAX_CONNECTION_BUFFER)
        .keep_alive(true);
    // Every connection holds a receiver: at shutdown each is told, and the server waits until
    // every one is gone (the connections ended).
    let (stop, stopping) = watch::channel(());
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // A free connection slot before it is served, when connections are capped.
        let slot = match &slots {
            Some(slots) => tokio::select! {
                slot = slots.clone().acquire_owned() => slot.ok(),
                () = &mut shutdown => break,
            },
            None => None,
        };
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(error = %err, "cannot set TCP_NODELAY");
        }
        let connection = Connection {
            app: app.clone(),
            peer,
            http: http.clone(),
            stop: stopping.clone(),
            limits: limits.clone(),
        };
        tokio::spawn(async move {
            let _slot = slot;
            connection.run(stream).await;
        });
    }
    drop(listener);
    if let Some(draining) = &limits.draining {
        draining.stop();
    }
    drop(stopping);
    let _ = stop.send(());
    if tokio::time::timeout(limits.shutdown_grace, stop.closed())
        .await
        .is_err()
    {
        tracing::warn!(grace = ?limits.shutdown_grace, "requests still running after the shutdown grace period were cut off");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A running server (its address, its stop switch, its task).
    type Running = (
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<std::io::Result<()>>,
    );

    async fn start(limits: ServeLimits) -> Running {
        let app = Router::new()
            .route("/", axum::routing::get(|| async { "hi" }))
            .route(
                "/slow",
                axum::routing::get(|| async {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    "late"
                }),
            );
        start_app(app, limits).await
    }

    async fn start_app(app: Router, limits: ServeLimits) -> Running {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(
            listener,
            app,
            async move {
                let _ = stopped.await;
            },
            limits,
        ));
        (addr, stop, task)
    }

    #[tokio::test]
    async fn silent_connections_are_closed_after_the_header_timeout() {
        let limits = ServeLimits {
            header_read_timeout: Duration::from_millis(300),
            ..ServeLimits::default()
        };
        let (addr, _stop, _task) = start(limits).await;
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        let started = Instant::now();
        let mut buf = [0u8; 256];
        let read = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf)).await;
        assert!(read.is_ok(), "the server never closed a silent connection");
        assert!(
            started.elapsed() >= Duration::from_millis(250),
            "{:?}",
            started.elapsed()
        );
        // Others are served meanwhile.
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        client.read_to_string(&mut answer).await.unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("hi"),
            "{answer}"
        );
    }

    #[tokio::test]
    async fn a_draining_server_closes_each_connection_after_its_answer_and_ends_long_polls() {
        let draining = Draining::new();
        let app = Router::new().route(
            "/poll",
            axum::routing::get({
                let draining = draining.clone();
                || async move {
                    draining.stopping().await;
                    "stopped"
                }
            }),
        );
        let limits = ServeLimits {
            draining: Some(draining.clone()),
            ..ServeLimits::default()
        };
        let (addr, stop, task) = start_app(app, limits).await;
        let mut poll = tokio::net::TcpStream::connect(addr).await.unwrap();
        poll.write_all(b"GET /poll HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        draining.begin();
        // Still served, but the connection is closed after the answer.
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        client
            .write_all(b"GET /nothing HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), client.read_to_string(&mut answer))
            .await
            .expect("the connection is closed after the answer")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
        assert!(answer.contains("connection: close"), "{answer}");
        // The long poll answers once the server stops accepting, and shutdown is not held.
        stop.send(()).unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), poll.read_to_string(&mut answer))
            .await
            .expect("the long poll ends at shutdown")
            .unwrap();
        assert!(answer.ends_with("stopped"), "{answer}");
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn shutdown_waits_for_in_flight_requests_at_most_the_grace_period() {
        let limits = ServeLimits {
            shutdown_grace: Duration::from_millis(300),
            ..ServeLimits::default()
        };
        let (addr, stop, task) = start(limits).await;
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        client
            .write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = Instant::now();
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(2),
            "{took:?}"
        );
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "the listener is closed"
        );
    }
}
