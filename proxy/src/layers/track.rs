//! Counting each proxied request from its arrival to the end of its answer: a [`Tracker`] made
//! here travels with the request and is finished by whoever ends it (the auth layer, the
//! handler, or the relay at the end of a streamed answer). With traces on, it carries the
//! request's trace too ([`RequestTrace`]).

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::extract::Request;
use tower::{Layer, Service};

use crate::relay::Tracker;
use crate::route::Route;
use crate::state::AppState;
use crate::trace::RequestTrace;
use pd_router::sync::lock;

/// The request's tracker, until someone takes it to finish it.
#[derive(Clone)]
pub(crate) struct TrackerSlot(Arc<Mutex<Option<Tracker>>>);

impl TrackerSlot {
    /// Takes the tracker (only the first caller gets it).
    pub(crate) fn take(&self) -> Option<Tracker> {
        lock(&self.0).take()
    }

    /// Gives the tracker the request's place among its tenant's requests in flight.
    pub(crate) fn hold(&self, in_flight: pd_router::tenants::InFlight) {
        if let Some(tracker) = lock(&self.0).as_mut() {
            tracker.hold(in_flight);
        }
    }
}

/// Layer: starts counting each request to a proxied route.
#[derive(Clone)]
pub(crate) struct TrackLayer(pub AppState);

impl<S> Layer<S> for TrackLayer {
    type Service = Track<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Track {
            inner,
            state: self.0.clone(),
        }
    }
}

/// The service of [`TrackLayer`].
#[derive(Clone)]
pub(crate) struct Track<S> {
    inner: S,
    state: AppState,
}

impl<S: Service<Request>> Service<Request> for Track<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        if let Some(route) = Route::at(request.uri().path()) {
            let mut tracker = Tracker::new(self.state.route_metrics(route).clone(), Instant::now());
            if pd_service::traces::enabled() {
                tracker.traced(RequestTrace::start(request.headers(), route));
            }
            request
                .extensions_mut()
                .insert(TrackerSlot(Arc::new(Mutex::new(Some(tracker)))));
        }
        self.inner.call(request)
    }
}
