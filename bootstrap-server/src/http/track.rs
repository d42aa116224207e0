//! Counting every request by route, method and status, and timing it to its answer's head.
//!
//! A tower layer with a future of its own rather than an axum `from_fn` middleware: that one
//! boxes a future and clones the route's boxed service on every request, a tenth of a
//! `GET /query`'s instructions.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::Method;
use axum::response::Response;
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use crate::metrics::Metrics;

/// Layer: counts and times every request in [`Metrics`].
#[derive(Clone)]
pub struct TrackLayer(pub Arc<Metrics>);

impl<S> Layer<S> for TrackLayer {
    type Service = Track<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Track {
            inner,
            metrics: self.0.clone(),
        }
    }
}

/// The service of [`TrackLayer`].
#[derive(Clone)]
pub struct Track<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S> Service<Request> for Track<S>
where
    S: Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Tracked<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let route = request.extensions().get::<MatchedPath>().cloned();
        let method = request.method().clone();
        Tracked {
            answer: self.inner.call(request),
            seen: Some(Seen {
                metrics: self.metrics.clone(),
                route,
                method,
                started: Instant::now(),
            }),
        }
    }
}

/// What is recorded once the answer is ready.
struct Seen {
    metrics: Arc<Metrics>,
    route: Option<MatchedPath>,
    method: Method,
    started: Instant,
}

pin_project! {
    /// The answer of [`Track`]: the inner one, counted when it is ready.
    pub struct Tracked<F> {
        #[pin]
        answer: F,
        seen: Option<Seen>,
    }
}

impl<F, E> Future for Tracked<F>
where
    F: Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let answer = ready!(this.answer.poll(cx));
        if let (Ok(response), Some(seen)) = (&answer, this.seen.take()) {
            seen.metrics.observe_http(
                seen.route.as_ref().map_or("unmatched", MatchedPath::as_str),
                seen.method.as_str(),
                response.status().as_str(),
                seen.started.elapsed(),
            );
        }
        Poll::Ready(answer)
    }
}
