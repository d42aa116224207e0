//! The body of a backend's answer, read as a stream under the call's time limit and, for an
//! answer being followed, a limit on its silences: one timer for both, re-armed only when it
//! fires (not at every chunk).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use futures_util::stream::Stream;
use futures_util::StreamExt;
use pd_service::error_chain;
use reqwest::header::HeaderValue;
use reqwest::StatusCode;
use tokio::time::Sleep;

use super::connections::PooledBody;
use super::error::{UpstreamError, MAX_ERROR_BODY};

/// The body of a backend's answer, read under the call's time limit.
pub(crate) struct Answer {
    pub(super) body: PooledBody,
    /// Fires at the call's deadline, or earlier at the end of the silence allowed.
    pub(super) deadline: Pin<Box<Sleep>>,
    /// The call's deadline.
    pub(super) due: Instant,
    pub(super) timeout: Duration,
    /// The silence allowed, and when the last bytes came (see [`Answer::limit_silences`]).
    pub(super) silence: Option<(Duration, Instant)>,
}

impl Stream for Answer {
    type Item = Result<Bytes, UpstreamError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let polled = loop {
            match this.body.poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => break Poll::Ready(Some(Ok(data))),
                    // Trailers carry nothing to relay.
                    Err(_) => continue,
                },
                Poll::Ready(Some(Err(err))) => {
                    break Poll::Ready(Some(Err(UpstreamError::Broken(error_chain(&err)))))
                }
                Poll::Ready(None) => break Poll::Ready(None),
                Poll::Pending => break Poll::Pending,
            }
        };
        match &polled {
            Poll::Ready(Some(Ok(_))) => {
                if let Some((_, last)) = &mut this.silence {
                    *last = Instant::now();
                }
            }
            Poll::Pending => return this.poll_timer(cx),
            _ => {}
        }
        polled
    }
}

impl Answer {
    /// Ends the answer with [`UpstreamError::Stalled`] should it send nothing for `limit`.
    pub(crate) fn limit_silences(&mut self, limit: Duration) {
        let now = Instant::now();
        self.silence = Some((limit, now));
        self.deadline
            .as_mut()
            .reset((now + limit).min(self.due).into());
    }

    /// While the body has nothing: its failure once the timer fires for the deadline or for
    /// a silence that lasted; a timer that fired early (bytes came since it was armed) is armed
    /// again for the silence's new end.
    fn poll_timer(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, UpstreamError>>> {
        while self.deadline.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            let Some((limit, last)) = self.silence.filter(|_| now < self.due) else {
                return Poll::Ready(Some(Err(UpstreamError::Timeout(self.timeout))));
            };
            if now >= last + limit {
                return Poll::Ready(Some(Err(UpstreamError::Stalled(limit))));
            }
            self.deadline
                .as_mut()
                .reset((last + limit).min(self.due).into());
        }
        Poll::Pending
    }
}

impl Answer {
    /// Reads the rest of the body into one buffer (no copy when it is one chunk).
    pub(super) async fn whole(&mut self, limit: usize) -> Result<Bytes, UpstreamError> {
        let Some(first) = self.next().await.transpose()? else {
            return Ok(Bytes::new());
        };
        let mut whole: Option<BytesMut> = None;
        while let Some(chunk) = self.next().await.transpose()? {
            let buffer = whole.get_or_insert_with(|| BytesMut::from(&first[..]));
            buffer.extend_from_slice(&chunk[..chunk.len().min(limit.saturating_sub(buffer.len()))]);
            if buffer.len() >= limit {
                break;
            }
        }
        Ok(match whole {
            Some(buffer) => buffer.freeze(),
            None => first,
        })
    }

    /// A non-2xx answer, read whole (up to 64 KiB), as the error it is.
    pub(super) async fn into_error(
        mut self,
        status: StatusCode,
        content_type: Option<HeaderValue>,
    ) -> UpstreamError {
        let body = self.whole(MAX_ERROR_BODY).await.unwrap_or_default();
        UpstreamError::Status {
            status,
            content_type,
            body: body.slice(..body.len().min(MAX_ERROR_BODY)),
        }
    }
}

/// The head of a backend's answer, with its body still to read.
pub(super) struct Head {
    pub(super) status: StatusCode,
    pub(super) content_type: Option<HeaderValue>,
    pub(super) content_length: Option<u64>,
    pub(super) body: Answer,
}
