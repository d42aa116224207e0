//! Streaming D's answer to the client as it arrives, while P's call (when still running) is
//! watched: if P fails once an SSE stream has begun, D is cancelled and the stream ends with an
//! error event. Dropping the relay (the client went away) cancels both calls.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::stream::Stream;
use futures_util::StreamExt;

use crate::error::ApiError;
use crate::metrics::{CallOutcome, Outcome, RouteMetrics};
use crate::trace::RequestTrace;
use crate::upstream::{Answer, DecodeStart, UpstreamError};
use pd_router::backend::Call;
use pd_router::placement::Watch;

/// How a request failed: what the client is told, and how it is counted.
pub(crate) type Failure = (ApiError, Outcome);

/// P's call: its whole answer, or the failure it means for the request.
pub(crate) type PrefillCall = BoxFuture<'static, Result<Bytes, Failure>>;

/// Lets P's call, still running when D's answer is complete, finish in the background (bounded
/// by the prefill timeout) instead of cutting it: D has the KV, so P's answer no longer matters,
/// and cutting the call would also throw its kept-alive connection away.
pub(crate) fn detach(prefill: PrefillCall) {
    tokio::spawn(async move {
        let _ = prefill.await;
    });
}

/// Counts one client request from its arrival to its end; dropped unfinished, it counts as
/// `client_disconnected`.
pub(crate) struct Tracker {
    metrics: Arc<RouteMetrics>,
    start: Instant,
    done: bool,
    /// The request's trace, with traces on.
    trace: Option<Box<RequestTrace>>,
}

impl Tracker {
    /// Starts counting a request that arrived at `start`.
    pub(crate) fn new(metrics: Arc<RouteMetrics>, start: Instant) -> Self {
        metrics.start();
        Tracker {
            metrics,
            start,
            done: false,
            trace: None,
        }
    }

    /// Traces the request (traces are on).
    pub(crate) fn traced(&mut self, trace: RequestTrace) {
        self.trace = Some(Box::new(trace));
    }

    /// The request's trace, with traces on.
    pub(crate) fn trace(&self) -> Option<&RequestTrace> {
        self.trace.as_deref()
    }

    /// The request's trace, with traces on.
    pub(crate) fn trace_mut(&mut self) -> Option<&mut RequestTrace> {
        self.trace.as_deref_mut()
    }

    /// When the request arrived.
    pub(crate) fn started(&self) -> Instant {
        self.start
    }

    /// The route's metrics.
    pub(crate) fn metrics(&self) -> &RouteMetrics {
        &self.metrics
    }

    /// Moves the request to other labels (its model's, once its body named it).
    pub(crate) fn retarget(&mut self, metrics: Arc<RouteMetrics>) {
        if !self.done && !Arc::ptr_eq(&self.metrics, &metrics) {
            self.metrics.leave();
            metrics.start();
            self.metrics = metrics;
        }
    }

    /// Counts the request as ended with `outcome` (only the first call counts).
    pub(crate) fn finish(&mut self, outcome: Outcome) {
        if !self.done {
            self.done = true;
            self.metrics.finish(outcome, self.start.elapsed());
            if let Some(trace) = &mut self.trace {
                trace.finish(outcome);
            }
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.finish(Outcome::ClientDisconnected);
    }
}

/// The body stream of a relayed answer.
pub(crate) struct Relay {
    first: Option<Bytes>,
    decode: Option<(Answer, Call)>,
    prefill: Option<PrefillCall>,
    sse: bool,
    tracker: Tracker,
    /// The answer's pace, watched to teach the engines' latency models.
    watch: Option<Watch>,
}

/// The error a broken non-SSE body ends with (the client sees the connection cut).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct RelayError(String);

impl Relay {
    /// Relays `decode`'s answer, of D's `call`; `prefill` is P's call when it has not ended
    /// yet. `sse` says the answer is an event stream, where errors can be told in-band.
    pub(crate) fn new(
        decode: DecodeStart,
        call: Call,
        prefill: Option<PrefillCall>,
        sse: bool,
        tracker: Tracker,
    ) -> Self {
        Relay {
            first: decode.first,
            decode: Some((decode.rest, call)),
            prefill,
            sse,
            tracker,
            watch: None,
        }
    }

    /// The same relay teaching `watch` the answer's pace (its first chunk already noted).
    pub(crate) fn watched(self, watch: Option<Watch>) -> Self {
        Relay { watch, ..self }
    }

    /// Ends the stream with `error`: an SSE error event, or a broken body.
    fn fail(
        &mut self,
        error: ApiError,
        outcome: Outcome,
    ) -> Poll<Option<Result<Bytes, RelayError>>> {
        self.decode = None;
        self.prefill = None;
        self.tracker.finish(outcome);
        Poll::Ready(Some(if self.sse {
            Ok(error.to_sse())
        } else {
            Err(RelayError(error.message))
        }))
    }
}

impl Stream for Relay {
    type Item = Result<Bytes, RelayError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Some(first) = this.first.take() {
            return Poll::Ready(Some(Ok(first)));
        }
        if let Some(prefill) = &mut this.prefill {
            if let Poll::Ready(result) = prefill.as_mut().poll(cx) {
                this.prefill = None;
                if let Err((error, outcome)) = result {
                    if this.sse {
                        return this.fail(error, outcome);
                    }
                    // A non-streamed answer only starts once D has generated all of it, so D
                    // already has the KV: P's late failure cannot spoil it.
                }
            }
        }
        let Some((stream, call)) = &mut this.decode else {
            return Poll::Ready(None);
        };
        match stream.poll_next_unpin(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                call.progressed();
                if let Some(watch) = &mut this.watch {
                    watch.chunk(&chunk);
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(err))) => {
                let (_, call) = this.decode.take().expect("decode is set");
                call.finish(err.outcome());
                let (error, outcome) = match err {
                    UpstreamError::Timeout(limit) => (
                        ApiError::gateway_timeout(format!(
                            "decode did not finish within the request timeout ({limit:?})"
                        )),
                        Outcome::DecodeTimeout,
                    ),
                    UpstreamError::Broken(cause) => (
                        ApiError::bad_gateway(format!("decode's answer broke off: {cause}")),
                        Outcome::StreamError,
                    ),
                    other => (
                        ApiError::bad_gateway(format!("decode's answer broke off: {other}")),
                        Outcome::StreamError,
                    ),
                };
                this.fail(error, outcome)
            }
            Poll::Ready(None) => {
                if let Some((_, call)) = this.decode.take() {
                    call.finish(CallOutcome::Ok);
                }
                if let Some(prefill) = this.prefill.take() {
                    detach(prefill);
                }
                this.tracker.finish(Outcome::Ok);
                if let Some(watch) = this.watch.take() {
                    watch.ended();
                }
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
