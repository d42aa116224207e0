//! The byte stream under a pooled connection: plain TCP, or TLS over it for `https://`
//! backends (rustls, HTTP/1.1 by ALPN, the trust and client certificate of `--upstream-ca`,
//! `--upstream-cert`), opened within the connect timeout with `TCP_NODELAY`.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use super::error::UpstreamError;
use pd_router::endpoint::Target;

/// A connection's bytes.
pub(super) enum Transport {
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
                return Ok(Transport::Plain(stream));
            };
            let name = ServerName::try_from(name.to_string()).map_err(|err| failed(&err))?;
            let stream = tls
                .connect(name, stream)
                .await
                .map_err(|err| failed(&err))?;
            Ok(Transport::Tls(Box::new(stream)))
        };
        match tokio::time::timeout(timeout, opening).await {
            Ok(opened) => opened,
            Err(_) => Err(failed(&format!("no connection within {timeout:?}"))),
        }
    }
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Transport::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Transport::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Transport::Tls(stream) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Transport::Plain(stream) => stream.is_write_vectored(),
            Transport::Tls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Transport::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Transport::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}
