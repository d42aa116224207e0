//! A layer that lets a request through or answers it at once, by a rule of the server's own
//! (a bearer token, the writer networks): the rule is a [`Gate`], the layer [`GateLayer`].

use std::future::{ready, Ready};
use std::task::{Context, Poll};

use axum::extract::Request;
use axum::response::Response;
use futures_util::future::Either;
use tower::{Layer, Service};

/// Decides whether a request goes on.
pub trait Gate {
    /// The answer `request` gets instead of going on; `None` lets it through. A gate may leave
    /// what it learned in the request's extensions (who the request comes from).
    fn refusal(&self, request: &mut Request) -> Option<Response>;
}

/// Layer: answers the requests its [`Gate`] refuses, passes the others on.
#[derive(Clone)]
pub struct GateLayer<G>(pub G);

impl<G: Clone, S> Layer<S> for GateLayer<G> {
    type Service = Gated<G, S>;

    fn layer(&self, inner: S) -> Self::Service {
        Gated {
            inner,
            gate: self.0.clone(),
        }
    }
}

/// The service of [`GateLayer`].
#[derive(Clone)]
pub struct Gated<G, S> {
    inner: S,
    gate: G,
}

impl<G, S> Service<Request> for Gated<G, S>
where
    G: Gate,
    S: Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        match self.gate.refusal(&mut request) {
            None => Either::Left(self.inner.call(request)),
            Some(refused) => Either::Right(ready(Ok(refused))),
        }
    }
}
