//! One accepted connection of [`crate::serve`], from its first byte to its end: through TLS
//! when the listener has it (plain HTTP on a TLS port answered with a 400), HTTP/1.1 or, by
//! ALPN, HTTP/2; each request given its peer and, when its client certificate verified,
//! [`ClientCertified`]; every answer `Connection: close` while the server drains; ended
//! gracefully when the server stops.
//!
//! A silent peer costs bounded time: HTTP/1.1 has its header read timeout; an HTTP/2
//! connection that moves no bytes for as long (a client that never sends its preface, or stays
//! idle between requests) is told to go away (`GOAWAY`: streams still running finish), as is
//! one whose server drains (HTTP/2 has no `Connection: close`).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::http::header::CONNECTION;
use axum::http::HeaderValue;
use axum::response::Response;
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tower::ServiceExt;

use crate::draining::Draining;
use crate::serve::ServeLimits;
use crate::tls::ClientCertified;
use crate::wire_errors::{JsonWireErrors, WireErrorBody};

/// The most requests one HTTP/2 connection may have in flight at once.
const MAX_HTTP2_STREAMS: u32 = 256;

/// The most bytes of headers an HTTP/2 request may carry.
const MAX_HTTP2_HEADERS: u32 = 128 * 1024;

/// One accepted connection and what serving it takes.
pub(crate) struct Connection {
    pub(crate) app: Router,
    pub(crate) peer: SocketAddr,
    pub(crate) http: http1::Builder,
    /// Changes when the server stops; held until the connection ends (the server waits for
    /// every one, within its grace).
    pub(crate) stop: watch::Receiver<()>,
    pub(crate) limits: ServeLimits,
}

impl Connection {
    /// Serves the connection until it ends: through TLS first when the listener has it.
    pub(crate) async fn run(self, stream: TcpStream) {
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
        let Connection {
            http,
            mut stop,
            limits,
            peer,
            ..
        } = self;
        let ended = match limits.wire_error_body {
            Some(render) => {
                let io = TokioIo::new(JsonWireErrors::new(io, render));
                let connection = pin!(http.serve_connection(io, service));
                until_stopped(connection, &mut stop, None, |c| c.graceful_shutdown()).await
            }
            None if limits.upgrades => {
                // Not drained at shutdown (see `ServeLimits::upgrades`): no stop watched.
                drop(stop);
                let io = TokioIo::new(io);
                http.serve_connection(io, service).with_upgrades().await
            }
            None => {
                let connection = pin!(http.serve_connection(TokioIo::new(io), service));
                until_stopped(connection, &mut stop, None, |c| c.graceful_shutdown()).await
            }
        };
        if let Err(err) = ended {
            tracing::debug!(%peer, error = %err, "connection ended with an error");
        }
    }

    async fn serve_http2<I>(self, io: I, certified: bool)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let service = self.service(certified);
        let mut http = http2::Builder::new(TokioExecutor::new());
        http.timer(TokioTimer::new())
            .max_concurrent_streams(MAX_HTTP2_STREAMS)
            .max_header_list_size(MAX_HTTP2_HEADERS);
        let (io, activity) = Active::new(io);
        let idle = Some(Idle {
            activity,
            limit: self.limits.header_read_timeout,
            draining: self.limits.draining.clone(),
        });
        let connection = pin!(http.serve_connection(TokioIo::new(io), service));
        let mut stop = self.stop;
        let ended = until_stopped(connection, &mut stop, idle, |c| c.graceful_shutdown()).await;
        if let Err(err) = ended {
            tracing::debug!(peer = %self.peer, error = %err, "connection ended with an error");
        }
    }
}

/// When an HTTP/2 connection is asked to go away before the server stops: after `limit`
/// without moving a byte, or once the server drains.
struct Idle {
    activity: Arc<Activity>,
    limit: Duration,
    draining: Option<Draining>,
}

impl Idle {
    fn should_end(&self) -> bool {
        self.activity.idle() >= self.limit
            || self.draining.as_ref().is_some_and(Draining::is_draining)
    }

    /// Whether the client has sent nothing at all for the limit (not even HTTP/2's preface):
    /// a connection that cannot end gracefully, closed instead.
    fn never_spoke(&self) -> bool {
        !self.activity.read_any.load(Ordering::Relaxed) && self.activity.idle() >= self.limit
    }
}

/// Drives `connection` to its end; when the server stops (or as `idle` says) it is asked to
/// end gracefully (`shut_down`): the requests in flight finish, no new one starts.
async fn until_stopped<C, E>(
    mut connection: Pin<&mut C>,
    stop: &mut watch::Receiver<()>,
    idle: Option<Idle>,
    shut_down: impl Fn(Pin<&mut C>),
) -> Result<(), E>
where
    C: Future<Output = Result<(), E>>,
{
    let mut asked = false;
    let check_every = idle
        .as_ref()
        .map_or(Duration::from_secs(3600), |idle| idle.limit / 4);
    let mut ticks = tokio::time::interval(check_every.max(Duration::from_millis(10)));
    loop {
        tokio::select! {
            ended = connection.as_mut() => return ended,
            changed = stop.changed(), if !asked => {
                // Changed, or the server is gone: either way, end.
                let _ = changed;
                asked = true;
                shut_down(connection.as_mut());
            }
            _ = ticks.tick(), if idle.is_some() => {
                if idle.as_ref().is_some_and(Idle::never_spoke) {
                    return Ok(());
                }
                if !asked && idle.as_ref().is_some_and(Idle::should_end) {
                    asked = true;
                    shut_down(connection.as_mut());
                }
            }
        }
    }
}

/// When a connection last moved bytes (milliseconds since it was made), and whether its client
/// ever sent any.
struct Activity {
    since: Instant,
    last_ms: AtomicU64,
    read_any: AtomicBool,
}

impl Activity {
    fn touch(&self) {
        let ms = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn idle(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.since.elapsed().saturating_sub(last)
    }
}

/// An IO stream that records when it last moved bytes.
struct Active<I> {
    inner: I,
    activity: Arc<Activity>,
}

impl<I> Active<I> {
    fn new(inner: I) -> (Self, Arc<Activity>) {
        let activity = Arc::new(Activity {
            since: Instant::now(),
            last_ms: AtomicU64::new(0),
            read_any: AtomicBool::new(false),
        });
        let active = Active {
            inner,
            activity: activity.clone(),
        };
        (active, activity)
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Active<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.read_any.store(true, Ordering::Relaxed);
            self.activity.touch();
        }
        polled
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Active<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

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
/// What the client sent is read first (for a moment), so that closing does not reset the
/// connection under the answer.
async fn refuse_plain_http(mut stream: TcpStream, render: Option<WireErrorBody>) {
    let mut sent = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_millis(50), stream.read(&mut sent)).await;
    let reason = "This port speaks TLS: use https://";
    let body = render.map_or_else(|| reason.as_bytes().to_vec(), |render| render(400, reason));
    let content_type = match render {
        Some(_) => "application/json",
        None => "text/plain",
    };
    let mut answer = format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    answer.extend_from_slice(&body);
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.write_all(&answer)).await;
    let _ = stream.shutdown().await;
    // Whatever else the client sent, read and dropped for a moment: a close with unread bytes
    // would reset the connection under the answer.
    let _ = tokio::time::timeout(Duration::from_millis(200), async {
        while matches!(stream.read(&mut sent).await, Ok(n) if n > 0) {}
    })
    .await;
}

/// `response`, with `Connection: close` while `draining`.
fn close_if_draining(mut response: Response, draining: &Option<Draining>) -> Response {
    if draining.as_ref().is_some_and(Draining::is_draining) {
        (response.headers_mut()).insert(CONNECTION, HeaderValue::from_static("close"));
    }
    response
}
