//! Counting each proxied request from its arrival to the end of its answer: a [`Tracker`] made
//! here travels with the request and is finished by whoever ends it (the auth layer, the
//! handler, or the relay at the end of a streamed answer).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;

use crate::relay::Tracker;
use crate::state::{AppState, Route};

/// The request's tracker, until someone takes it to finish it.
#[derive(Clone)]
pub struct TrackerSlot(Arc<Mutex<Option<Tracker>>>);

impl TrackerSlot {
    /// Takes the tracker (only the first caller gets it).
    pub fn take(&self) -> Option<Tracker> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// Middleware: starts counting a request to a proxied route.
pub async fn track(State(state): State<AppState>, mut request: Request, next: Next) -> Response {
    if let Some(route) = Route::at(request.uri().path()) {
        let tracker = Tracker::new(state.route_metrics(route).clone(), Instant::now());
        request
            .extensions_mut()
            .insert(TrackerSlot(Arc::new(Mutex::new(Some(tracker)))));
    }
    next.run(request).await
}
