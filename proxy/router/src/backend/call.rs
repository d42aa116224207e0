//! [`Call`]: one call to a backend in flight, counted on the backend (and its pair) until it
//! is finished or dropped.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Backend, Pair};
use crate::metrics::CallOutcome;

/// One call to a backend in flight; see [`Backend::call`].
pub struct Call {
    pub(super) backend: Arc<Backend>,
    pub(super) pair: Option<Arc<Pair>>,
    pub(super) finished: bool,
}

impl Call {
    /// The backend called.
    pub fn backend(&self) -> &Arc<Backend> {
        &self.backend
    }

    /// Counts one sign of life of the backend: the answer began, or a chunk of it arrived.
    pub fn progressed(&self) {
        self.backend.progressed();
    }

    /// Counts the call as ended with `outcome`.
    pub fn finish(mut self, outcome: CallOutcome) {
        self.finished = true;
        match outcome {
            CallOutcome::ConnectError => self.backend.eject("connection refused"),
            CallOutcome::Ok | CallOutcome::HttpError => self.backend.progressed(),
            _ => {}
        }
        self.backend.metrics.call(outcome);
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if !self.finished {
            self.backend.metrics.call(CallOutcome::Cancelled);
        }
        self.backend.outstanding.fetch_sub(1, Ordering::Relaxed);
        self.backend.metrics.in_flight.dec();
        if let Some(pair) = &self.pair {
            pair.outstanding.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
