//! The fourth stage: D's answer relayed to the client as it arrives ([`Relay`]), while P's call
//! (when still running) is watched, and the request counted from its arrival to its end
//! ([`Tracker`]). A streamed answer that can be continued exactly is followed event by event
//! ([`resume`]): should its decode fail mid-answer, it goes on on another decode.

mod events;
mod progress;
mod resume;
mod scan;
mod stream;

use pd_router::tenants::InFlight;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures_util::future::BoxFuture;

use crate::error::ApiError;
use crate::metrics::{Outcome, RouteMetrics};
use crate::trace::RequestTrace;

pub(crate) use progress::{Asked, Continuation, Shape};
pub(crate) use resume::{Continuer, Resumed, Resumption};
pub(crate) use stream::Relay;

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
    /// Its place among its tenant's requests in flight, given back when it ends.
    in_flight: Option<InFlight>,
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
            in_flight: None,
        }
    }

    /// Holds the request's place among its tenant's requests in flight until it ends.
    pub(crate) fn hold(&mut self, in_flight: InFlight) {
        self.in_flight = Some(in_flight);
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
    pub(crate) fn metrics(&self) -> &Arc<RouteMetrics> {
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
