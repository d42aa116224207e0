//! Kept-alive HTTP/1 connections to backends (plain HTTP, or TLS: [`super::transport`]), each
//! driven by the call using it.
//!
//! A hyper connection does nothing unless it is polled. hyper-util's pooled client polls each
//! one on a task of its own, so every answer wakes that task, which hands the bytes over a
//! channel and wakes the caller's task in turn. Here a call takes a connection out of the pool
//! and polls it itself, along with the answer it waits for: the bytes that arrive wake the one
//! task that wants them. When the answer's body has ended, the connection goes back to the
//! pool, ready for the next call to the same backend.
//!
//! Nothing polls a connection while it waits in the pool, so a backend that closed it is only
//! noticed when it is taken out again (it is then dropped and the next one tried), or by the
//! sweep that closes connections idle for too long.
//!
//! Each serving thread ([`pd_service::serve_on_cores`]) has a pool of its own: a connection
//! is registered with the runtime of the thread that opened it, so its bytes wake that thread
//! only, and no lock is shared between threads. Calls from any other thread (the control
//! plane's) share one more pool.

use std::collections::{HashMap, VecDeque};
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::{Body as _, Frame, Incoming};
use hyper::client::conn::http1;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use pd_router::endpoint::Target;
use pd_service::error_chain;
use tokio_rustls::TlsConnector;

use super::error::UpstreamError;
use super::transport::Transport;
use pd_router::sync::lock;

/// The most idle connections kept per backend; more are closed when their call ends.
const MAX_IDLE_PER_BACKEND: usize = 512;

/// The connection itself: polling it writes requests and reads answers.
type Driver = http1::Connection<TokioIo<Transport>, Full<Bytes>>;

/// One HTTP/1 connection: the handle requests are sent through, and the connection to poll
/// (large, so it is kept boxed and moved as a pointer).
struct Connection {
    sender: http1::SendRequest<Full<Bytes>>,
    driver: Driver,
    /// Its transport's writes failed (see [`Transport::write_failed`]): never reused.
    write_failed: Arc<AtomicBool>,
}

impl Connection {
    /// Polls the connection; `true` when it has ended (closed or failed) and must be dropped.
    fn poll_ended(&mut self, cx: &mut Context<'_>) -> bool {
        Pin::new(&mut self.driver).poll(cx).is_ready()
    }

    /// Whether a new request can be sent now (polls the connection first, so a close that
    /// arrived while it waited is seen).
    fn ready(&mut self, cx: &mut Context<'_>) -> bool {
        !self.write_failed.load(Ordering::Relaxed)
            && !self.poll_ended(cx)
            && matches!(self.sender.poll_ready(cx), Poll::Ready(Ok(())))
    }
}

/// A connection waiting in the pool, and since when.
struct Idle {
    connection: Box<Connection>,
    since: Instant,
}

/// The idle connections of every backend, by its [`Target::key`] (`host:port`, or
/// `https://host:port`). Keyed by the text (hosts come lowercased from the URL parser) rather
/// than an `Authority`, whose hash feeds the hasher one lowercased byte at a time (a fifth of
/// the pool's work per call), and hashed with foldhash: the keys are the operator's backends,
/// not the clients'.
type IdleByBackend = HashMap<Box<str>, VecDeque<Idle>, foldhash::fast::RandomState>;

/// The pools of idle connections, per backend: one per serving thread, the last one for calls
/// from any other thread.
pub(super) struct Connections {
    idle: Box<[Mutex<IdleByBackend>]>,
    /// How `https://` backends are reached (`--upstream-ca`, `--upstream-cert`).
    tls: TlsConnector,
    connect_timeout: Duration,
    idle_timeout: Duration,
}

impl Connections {
    /// Empty pools for `serving_threads` threads and the others; new connections get
    /// `connect_timeout`, and idle ones are closed by [`sweep`](Connections::sweep) after
    /// `idle_timeout`.
    pub(super) fn new(
        tls: TlsConnector,
        connect_timeout: Duration,
        idle_timeout: Duration,
        serving_threads: usize,
    ) -> Arc<Self> {
        Arc::new(Connections {
            idle: (0..=serving_threads)
                .map(|_| Mutex::new(IdleByBackend::default()))
                .collect(),
            tls,
            connect_timeout,
            idle_timeout,
        })
    }

    /// Sends `request` (origin-form URI, `Host` set) to the backend at `target` and waits
    /// for the head of its answer. A kept-alive connection is used when one is ready; one that
    /// turns out closed before the request was written is dropped and the request goes on the
    /// next (each idle connection is tried at most once, then a new one is made).
    pub(super) async fn send(
        self: &Arc<Self>,
        target: &Target,
        mut request: Request<Full<Bytes>>,
    ) -> Result<Response<PooledBody>, UpstreamError> {
        let shard = self.shard();
        loop {
            let pooled = poll_fn(|cx| Poll::Ready(self.checkout(shard, &target.key, cx))).await;
            let (mut connection, reused) = match pooled {
                Some(connection) => (connection, true),
                None => (self.connect(target).await?, false),
            };
            let mut ended = false;
            let answer = {
                let Connection { sender, driver, .. } = &mut *connection;
                let mut answer = pin!(sender.try_send_request(request));
                poll_fn(|cx| {
                    // Once ended, any error reaches the answer through hyper.
                    ended = ended || Pin::new(&mut *driver).poll(cx).is_ready();
                    answer.as_mut().poll(cx)
                })
                .await
            };
            match answer {
                Ok(response) => {
                    let home = Home {
                        pool: self.clone(),
                        shard,
                        key: target.key.clone(),
                    };
                    return Ok(response.map(|body| PooledBody {
                        body,
                        connection: (!ended).then_some(connection),
                        home,
                    }));
                }
                Err(mut failed) => match failed.take_message() {
                    Some(unsent) if reused => request = unsent,
                    _ => return Err(UpstreamError::Broken(error_chain(failed.error()))),
                },
            }
        }
    }

    /// The pool of the calling thread.
    fn shard(&self) -> usize {
        let others = self.idle.len() - 1;
        pd_service::current_core().map_or(others, |core| core.min(others))
    }

    /// Takes the most recently used idle connection to the backend `key` in pool `shard` that
    /// is still ready, dropping those that are not (closed by the backend, or idle too long).
    fn checkout(&self, shard: usize, key: &str, cx: &mut Context<'_>) -> Option<Box<Connection>> {
        loop {
            // The most recent first: the one least likely to have been closed.
            let Idle {
                mut connection,
                since,
            } = lock(&self.idle[shard]).get_mut(key)?.pop_back()?;
            if since.elapsed() < self.idle_timeout && connection.ready(cx) {
                return Some(connection);
            }
        }
    }

    /// Opens a new connection to `target` (within the connect timeout, `TCP_NODELAY` set,
    /// through TLS for `https://`).
    async fn connect(&self, target: &Target) -> Result<Box<Connection>, UpstreamError> {
        let transport = Transport::open(target, &self.tls, self.connect_timeout).await?;
        let write_failed = transport.write_failed();
        let (sender, driver) = http1::handshake(TokioIo::new(transport))
            .await
            .map_err(|err| UpstreamError::Connect(error_chain(&err)))?;
        Ok(Box::new(Connection {
            sender,
            driver,
            write_failed,
        }))
    }

    /// Puts a connection whose answer has ended back in pool `shard`, if it can take another
    /// request.
    fn release(
        &self,
        shard: usize,
        key: &str,
        mut connection: Box<Connection>,
        cx: &mut Context<'_>,
    ) {
        if !connection.ready(cx) {
            return;
        }
        let mut idle = lock(&self.idle[shard]);
        let queue = match idle.get_mut(key) {
            Some(queue) => queue,
            None => idle.entry(key.into()).or_default(),
        };
        if queue.len() < MAX_IDLE_PER_BACKEND {
            queue.push_back(Idle {
                connection,
                since: Instant::now(),
            });
        }
    }

    /// Closes the connections idle longer than the idle timeout and those the backend closed.
    pub(super) fn sweep(&self) {
        let mut cx = Context::from_waker(Waker::noop());
        for shard in &self.idle {
            let mut idle = lock(shard);
            for queue in idle.values_mut() {
                queue.retain_mut(|waiting| {
                    waiting.since.elapsed() < self.idle_timeout
                        && !waiting.connection.poll_ended(&mut cx)
                });
            }
            idle.retain(|_, queue| !queue.is_empty());
        }
    }

    /// Sweeps every `period`, for as long as the pool is used elsewhere.
    pub(super) async fn sweep_forever(pool: std::sync::Weak<Self>, period: Duration) {
        let mut ticks = tokio::time::interval(period);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            match pool.upgrade() {
                Some(pool) => pool.sweep(),
                None => return,
            }
        }
    }
}

/// Where a connection goes back to: the pool of the thread that took it out.
struct Home {
    pool: Arc<Connections>,
    shard: usize,
    key: Arc<str>,
}

/// The body of an answer, with the connection it arrives on: reading the body polls the
/// connection, and the end of the body puts the connection back in the pool. Dropped before
/// its end, it closes the connection (HTTP/1 cannot abandon an answer halfway).
pub(super) struct PooledBody {
    body: Incoming,
    connection: Option<Box<Connection>>,
    home: Home,
}

impl PooledBody {
    /// The length the backend announced, if it did.
    pub(super) fn exact_length(&self) -> Option<u64> {
        self.body.size_hint().exact()
    }

    /// The next frame of the body, as [`hyper::body::Body::poll_frame`].
    pub(super) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(connection) = self.connection.as_mut() {
            if connection.poll_ended(cx) {
                self.connection = None;
            }
        }
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            if let Some(connection) = self.connection.take() {
                let Home { pool, shard, key } = &self.home;
                pool.release(*shard, key, connection, cx);
            }
        }
        polled
    }
}

impl Drop for PooledBody {
    /// A body read to its announced length without its end being polled (a whole answer in
    /// one chunk) still leaves a reusable connection.
    fn drop(&mut self) {
        if self.body.is_end_stream() {
            if let Some(connection) = self.connection.take() {
                let mut cx = Context::from_waker(Waker::noop());
                let Home { pool, shard, key } = &self.home;
                pool.release(*shard, key, connection, &mut cx);
            }
        }
    }
}
