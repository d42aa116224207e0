//! Errors hyper answers by itself, before any handler or layer sees the request: a malformed
//! request line or header (400), a URI over 64 KiB (414), too many or too large headers (431).
//! hyper sends them with an empty body and no content type; [`JsonWireErrors`] wraps a
//! connection and rewrites exactly those answers into JSON, so that every error a client of a
//! pd-bootstrap server sees has a body it can parse.
//!
//! Every answer a server's own handlers make carries a content type (the servers' layers give
//! every error a JSON body), so an error head with `content-length: 0` and no content type can
//! only be hyper's. hyper writes such a head in one piece and closes the connection after it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Renders the JSON body of a protocol error: `(status code, reason phrase) -> body`.
pub type WireErrorBody = fn(u16, &str) -> Vec<u8>;

/// A connection whose bodiless protocol-error answers are rewritten into JSON.
pub struct JsonWireErrors<T> {
    inner: T,
    render: WireErrorBody,
    /// A rewritten answer still to be written.
    pending: Vec<u8>,
    written: usize,
}

impl<T> JsonWireErrors<T> {
    /// Wraps `inner`, rendering error bodies with `render`.
    pub fn new(inner: T, render: WireErrorBody) -> Self {
        JsonWireErrors {
            inner,
            render,
            pending: Vec::new(),
            written: 0,
        }
    }
}

/// The JSON answer replacing `head` when `head` is one of hyper's own error answers.
fn rewrite(head: &[u8], render: WireErrorBody) -> Option<Vec<u8>> {
    let rest = head.strip_prefix(b"HTTP/1.1 ")?;
    let end = head.windows(4).position(|w| w == b"\r\n\r\n")?;
    if end + 4 != head.len() {
        return None;
    }
    let text = std::str::from_utf8(&head[..end]).ok()?;
    let lower = text.to_ascii_lowercase();
    if !lower.contains("\r\ncontent-length: 0") || lower.contains("\r\ncontent-type:") {
        return None;
    }
    let status_line = text.lines().next()?;
    let code: u16 = std::str::from_utf8(rest.get(..3)?).ok()?.parse().ok()?;
    if !(400..600).contains(&code) {
        return None;
    }
    let reason = status_line.get(13..).unwrap_or("").trim();
    let body = render(code, reason);
    let mut answer = format!(
        "{status_line}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    answer.extend_from_slice(&body);
    Some(answer)
}

impl<T: AsyncWrite + Unpin> JsonWireErrors<T> {
    /// Writes what is pending; ready once all of it is out.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.written < self.pending.len() {
            let n = std::task::ready!(
                Pin::new(&mut self.inner).poll_write(cx, &self.pending[self.written..])
            )?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for JsonWireErrors<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for JsonWireErrors<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        std::task::ready!(this.drain(cx))?;
        if buf.starts_with(b"HTTP/1.1 4") || buf.starts_with(b"HTTP/1.1 5") {
            if let Some(answer) = rewrite(buf, this.render) {
                this.pending = answer;
                this.written = 0;
                // Taken whole: the rewritten answer goes out on this and the next calls.
                let _ = this.drain(cx)?;
                return Poll::Ready(Ok(buf.len()));
            }
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        std::task::ready!(this.drain(cx))?;
        let whole: usize = bufs.iter().map(|b| b.len()).sum();
        if let Some(answer) = bufs
            .first()
            .filter(|first| first.len() == whole)
            .and_then(|first| rewrite(first, this.render))
        {
            this.pending = answer;
            this.written = 0;
            let _ = this.drain(cx)?;
            return Poll::Ready(Ok(whole));
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.drain(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.drain(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(code: u16, reason: &str) -> Vec<u8> {
        format!("{{\"detail\":\"{code} {reason}\"}}").into_bytes()
    }

    #[test]
    fn only_hypers_bodiless_errors_are_rewritten() {
        let hyper = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let answer = String::from_utf8(rewrite(hyper, body).unwrap()).unwrap();
        assert!(answer.starts_with(
            "HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        ));
        assert!(answer.ends_with("\r\n\r\n{\"detail\":\"431 Request Header Fields Too Large\"}"));
        let handler = b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n";
        assert!(rewrite(handler, body).is_none());
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        assert!(rewrite(ok, body).is_none());
        let with_body = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\nextra";
        assert!(rewrite(with_body, body).is_none());
    }
}
