//! What a request holds on a backend besides its calls: a [`Reservation`] (counted in flight
//! before its call exists: a decode chosen while the request's prefill runs first) and an
//! [`AwaitingPrefill`] (a decode called while the request's prefill still runs: the engine
//! counts it waiting, for its KV, not for a place in its batch).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::Backend;

/// A request bound for a backend, counted in flight there until dropped.
pub struct Reservation(Arc<Backend>);

/// A decode's request whose prefill has not answered, until dropped.
pub struct AwaitingPrefill(Arc<Backend>);

impl Backend {
    /// Counts a request bound for it in flight (its load and saturation) until the guard is
    /// dropped, before its call is made.
    pub fn reserve(self: &Arc<Self>) -> Reservation {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        Reservation(self.clone())
    }

    /// Counts a request sent to this decode whose prefill still runs until the guard is
    /// dropped: its engine reports it among the requests waiting, though it waits for its KV
    /// (vLLM's remote-KV wait), which is no sign of a full batch.
    pub fn await_prefill(self: &Arc<Self>) -> AwaitingPrefill {
        self.awaiting_prefill.fetch_add(1, Ordering::Relaxed);
        AwaitingPrefill(self.clone())
    }

    /// This process's requests on it whose prefill still runs.
    pub fn awaiting_prefill(&self) -> usize {
        self.awaiting_prefill.load(Ordering::Relaxed)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for AwaitingPrefill {
    fn drop(&mut self) {
        self.0.awaiting_prefill.fetch_sub(1, Ordering::Relaxed);
    }
}
