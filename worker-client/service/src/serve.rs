//! Serving an axum router with the limits a long-running server needs.
//!
//! `axum::serve` reads request headers without a time limit (a client that connects and sends
//! nothing keeps its connection, and a file descriptor, forever) and its graceful shutdown waits
//! for every connection however long it streams. [`serve`] is the same accept loop with a header
//! read timeout, `TCP_NODELAY` on every connection, and a bounded grace period at shutdown (after
//! the not-ready delay of a [`Draining`] server, when it has one).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::http::header::CONNECTION;
use axum::http::HeaderValue;
use axum::response::Response;
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower::ServiceExt;

use crate::draining::Draining;
use crate::tls::{ClientCertified, ServerTls};
use crate::wire_errors::{JsonWireErrors, WireErrorBody};

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
            stop: Some(stop),
            task,
        }
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, the base URL clients use.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
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
    /// The most connections open at once; the next ones wait in the listen backlog until one
    /// closes. `None`: no cap.
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
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        // What a connection may buffer before the handler reads it (headers must fit): bounds
        // the memory of many slow clients.
        .max_buf_size(MAX_CONNECTION_BUFFER)
        .keep_alive(true);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    let slots = limits
        .max_connections
        .map(|n| std::sync::Arc::new(tokio::sync::Semaphore::new(n.max(1))));
    loop {
        // A free connection slot before the next accept, when connections are capped.
        let slot = match &slots {
            Some(slots) => tokio::select! {
                slot = slots.clone().acquire_owned() => slot.ok(),
                () = &mut shutdown => break,
            },
            None => None,
        };
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
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(error = %err, "cannot set TCP_NODELAY");
        }
        let connection = Connection {
            app: app.clone(),
            peer,
            http: http.clone(),
            graceful: graceful.watcher(),
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
    if tokio::time::timeout(limits.shutdown_grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(grace = ?limits.shutdown_grace, "requests still running after the shutdown grace period were cut off");
    }
    Ok(())
}

/// One accepted connection and what serving it takes.
struct Connection {
    app: Router,
    peer: SocketAddr,
    http: http1::Builder,
    graceful: Watcher,
    limits: ServeLimits,
}

impl Connection {
    /// Serves the connection until it ends: through TLS first when the listener has it.
    async fn run(self, stream: TcpStream) {
        let Some(tls) = self.limits.tls.clone() else {
            return self.serve_http1(stream, false).await;
        };
        if !starts_tls(&stream, self.limits.header_read_timeout).await {
            return refuse_plain_http(stream, self.limits.wire_error_body).await;
        }
        let handshake = tls.acceptor().accept(stream);
        let stream = match tokio::time::timeout(self.limits.header_read_timeout, handshake).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(err)) => {
                return tracing::debug!(peer = %self.peer, error = %err, "TLS handshake failed")
            }
            Err(_) => return tracing::debug!(peer = %self.peer, "TLS handshake timed out"),
        };
        let (_, session) = stream.get_ref();
        let certified = session.peer_certificates().is_some_and(|c| !c.is_empty());
        match session.alpn_protocol() {
            Some(b"h2") => self.serve_http2(stream, certified).await,
            _ => self.serve_http1(stream, certified).await,
        }
    }

    /// The router as a hyper service: each request carries its peer (handlers and layers that
    /// need it read it, e.g. write allow-lists) and whether its client certificate verified,
    /// and its answer says `Connection: close` while the server drains.
    fn service(
        &self,
        certified: bool,
    ) -> impl hyper::service::Service<
        Request<Incoming>,
        Response = Response,
        Error = Infallible,
        Future = impl Future<Output = Result<Response, Infallible>> + Send + 'static,
    > + Clone
           + Send
           + 'static {
        let peer = self.peer;
        let service = self
            .app
            .clone()
            .map_request(move |request: Request<Incoming>| {
                let mut request = request.map(Body::new);
                request.extensions_mut().insert(ConnectInfo(peer));
                if certified {
                    request.extensions_mut().insert(ClientCertified);
                }
                request
            });
        let draining = self.limits.draining.clone();
        TowerToHyperService::new(
            service.map_response(move |response| close_if_draining(response, &draining)),
        )
    }

    async fn serve_http1<I>(self, io: I, certified: bool)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let service = self.service(certified);
        let ended = match self.limits.wire_error_body {
            Some(render) => {
                let io = TokioIo::new(JsonWireErrors::new(io, render));
                (self.graceful)
                    .watch(self.http.serve_connection(io, service))
                    .await
            }
            None if self.limits.upgrades => {
                // Not drained at shutdown (see `ServeLimits::upgrades`): no watcher held.
                drop(self.graceful);
                let io = TokioIo::new(io);
                self.http
                    .serve_connection(io, service)
                    .with_upgrades()
                    .await
            }
            None => {
                let io = TokioIo::new(io);
                (self.graceful)
                    .watch(self.http.serve_connection(io, service))
                    .await
            }
        };
        if let Err(err) = ended {
            tracing::debug!(peer = %self.peer, error = %err, "connection ended with an error");
        }
    }

    async fn serve_http2<I>(self, io: I, certified: bool)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let mut http = http2::Builder::new(TokioExecutor::new());
        http.timer(TokioTimer::new())
            .max_concurrent_streams(MAX_HTTP2_STREAMS)
            .max_header_list_size(MAX_CONNECTION_BUFFER as u32);
        let connection = http.serve_connection(TokioIo::new(io), self.service(certified));
        if let Err(err) = self.graceful.watch(connection).await {
            tracing::debug!(peer = %self.peer, error = %err, "connection ended with an error");
        }
    }
}

/// The most requests one HTTP/2 connection may have in flight at once.
const MAX_HTTP2_STREAMS: u32 = 256;

/// Whether the client's first byte opens a TLS handshake (a record of type 22), waiting for it
/// at most `timeout`. A client that sends nothing in time gets the handshake's own timeout.
async fn starts_tls(stream: &TcpStream, timeout: Duration) -> bool {
    let mut first = [0u8; 1];
    match tokio::time::timeout(timeout, stream.peek(&mut first)).await {
        Ok(Ok(1)) => first[0] == 0x16,
        _ => true,
    }
}

/// Answers a plain HTTP request on a TLS port with a 400 that says to use https, and closes.
async fn refuse_plain_http(mut stream: TcpStream, render: Option<WireErrorBody>) {
    let reason = "This port speaks TLS: use https://";
    let body = render.map_or_else(|| reason.as_bytes().to_vec(), |render| render(400, reason));
    let content_type = if render.is_some() {
        "application/json"
    } else {
        "text/plain"
    };
    let mut answer = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    answer.extend_from_slice(&body);
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.write_all(&answer)).await;
    let _ = stream.shutdown().await;
}

/// `response`, with `Connection: close` while `draining`.
fn close_if_draining(mut response: Response, draining: &Option<Draining>) -> Response {
    if draining.as_ref().is_some_and(Draining::is_draining) {
        (response.headers_mut()).insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
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
