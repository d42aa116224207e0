//! `X-Request-Id`: the client's, or a new one; handed to the handler (which sends it to P and
//! D) and set on the answer.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use axum::extract::Request;
use axum::http::HeaderValue;
use axum::response::Response;
use pin_project_lite::pin_project;
use tower::{Layer, Service};

use crate::ids::X_REQUEST_ID;
use crate::state::AppState;

/// The id of the request being served.
#[derive(Clone)]
pub(crate) struct RequestId(pub HeaderValue);

/// Layer: assigns each request its id and puts it on the answer.
#[derive(Clone)]
pub(crate) struct AssignRequestIdLayer(pub AppState);

impl<S> Layer<S> for AssignRequestIdLayer {
    type Service = AssignRequestId<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AssignRequestId {
            inner,
            state: self.0.clone(),
        }
    }
}

/// The service of [`AssignRequestIdLayer`].
#[derive(Clone)]
pub(crate) struct AssignRequestId<S> {
    inner: S,
    state: AppState,
}

impl<S> Service<Request> for AssignRequestId<S>
where
    S: Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = WithRequestId<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        let id = self.state.ids.request_id(request.headers());
        request.extensions_mut().insert(RequestId(id.clone()));
        WithRequestId {
            answer: self.inner.call(request),
            id: Some(id),
        }
    }
}

pin_project! {
    /// The answer of [`AssignRequestId`]: the inner one, with the request's id.
    pub struct WithRequestId<F> {
        #[pin]
        answer: F,
        id: Option<HeaderValue>,
    }
}

impl<F, E> Future for WithRequestId<F>
where
    F: Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut response = ready!(this.answer.poll(cx))?;
        if let Some(id) = this.id.take() {
            response.headers_mut().insert(X_REQUEST_ID.clone(), id);
        }
        Poll::Ready(Ok(response))
    }
}
