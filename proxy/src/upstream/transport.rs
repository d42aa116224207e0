//! The byte stream under a pooled connection: plain TCP, or TLS over it for `https://`
//! backends (rustls, HTTP/1.1 by ALPN, the trust and client certificate of `--upstream-ca`,
//! `--upstream-cert`), opened within the connect timeout with `TCP_NODELAY`.
//!
//! An engine may answer a request before it has read its body, and close: a prompt over its
//! body limit gets its `413` as soon as the headers say how long the body is. Writing the rest
//! then fails (a broken pipe, a reset), and the answer waiting to be read would be lost behind
//! the proxy's own write error. So once a write fails that way, the transport takes every
//! further write without sending it and lets the answer be read; the connection is then never
//! used again ([`Transport::write_failed`]).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use super::error::UpstreamError;
use pd_router::endpoint::Target;

/// A connection's bytes, and whether writing them has failed.
pub(super) struct Transport {
    stream: Stream,
    write_failed: Arc<AtomicBool>,
}

enum Stream {
    Plain(TcpStream),
    /// Boxed: a TLS session is large, and the pool moves connections.
    Tls(Box<TlsStream<TcpStream>>),
}

impl Transport {
    /// Opens a connection to `target` within `timeout` (the TLS handshake included).
    pub(super) async fn open(
        target: &Target,
        tls: &TlsConnector,
        timeout: Duration,
    ) -> Result<Self, UpstreamError> {
        let failed = |err: &dyn std::fmt::Display| {
            UpstreamError::Connect(format!("{}: {err}", target.authority))
        };
        let opening = async {
            let stream = TcpStream::connect(target.authority.as_str())
                .await
                .map_err(|err| failed(&err))?;
            stream.set_nodelay(true).map_err(|err| failed(&err))?;
            let Some(name) = &target.tls_name else {
                return Ok(Stream::Plain(stream));
            };
            let name = ServerName::try_from(name.to_string()).map_err(|err| failed(&err))?;
            let stream = tls
                .connect(name, stream)
                .await
                .map_err(|err| failed(&err))?;
            Ok(Stream::Tls(Box::new(stream)))
        };
        match tokio::time::timeout(timeout, opening).await {
            Ok(opened) => Ok(Transport {
                stream: opened?,
                write_failed: Arc::default(),
            }),
            Err(_) => Err(failed(&format!("no connection within {timeout:?}"))),
        }
    }

    /// Set once a write failed because the backend closed or reset the connection: the
    /// connection must not carry another request.
    pub(super) fn write_failed(&self) -> Arc<AtomicBool> {
        self.write_failed.clone()
    }

    /// `written` as the caller sees it: a write the backend cut short by closing is taken as
    /// done (`len` bytes), so that its answer can still be read.
    fn unless_cut_off(
        &self,
        written: Poll<io::Result<usize>>,
        len: usize,
    ) -> Poll<io::Result<usize>> {
        match written {
            Poll::Ready(Err(err)) if cut_off(&err) => {
                self.write_failed.store(true, Ordering::Relaxed);
                Poll::Ready(Ok(len))
            }
            other => other,
        }
    }

    fn writes_dropped(&self) -> bool {
        self.write_failed.load(Ordering::Relaxed)
    }
}

/// Whether a write failed because the backend closed or reset the connection.
fn cut_off(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
    )
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.get_mut().stream {
            Stream::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.writes_dropped() {
            return Poll::Ready(Ok(buf.len()));
        }
        let written = match &mut this.stream {
            Stream::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        };
        this.unless_cut_off(written, buf.len())
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let len = bufs.iter().map(|buf| buf.len()).sum();
        if this.writes_dropped() {
            return Poll::Ready(Ok(len));
        }
        let written = match &mut this.stream {
            Stream::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
        };
        this.unless_cut_off(written, len)
    }

    fn is_write_vectored(&self) -> bool {
        match &self.stream {
            Stream::Plain(stream) => stream.is_write_vectored(),
            Stream::Tls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.writes_dropped() {
            return Poll::Ready(Ok(()));
        }
        let flushed = match &mut this.stream {
            Stream::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        };
        this.unless_cut_off(flushed.map_ok(|()| 0), 0)
            .map_ok(|_| ())
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().stream {
            Stream::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Stream::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}
