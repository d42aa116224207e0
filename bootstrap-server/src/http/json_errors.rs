//! Gives bodiless error answers made below the handlers (405 from the router, 408 from the
//! timeout layer) a JSON body, so every error a client sees has a body it can parse. Errors
//! with a body of their own (SGLang's routes answer text, as SGLang's server does) pass.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use axum::body::{Body, HttpBody};
use axum::extract::Request;
use axum::http::{header, HeaderValue, Method, StatusCode, Uri};
use axum::response::Response;
use pd_protocol::ErrorBody;
use pin_project_lite::pin_project;
use tower::{Layer, Service};

/// Layer: answers bodiless errors with `{"detail": "..."}`.
#[derive(Clone, Copy, Default)]
pub struct JsonErrorsLayer;

impl<S> Layer<S> for JsonErrorsLayer {
    type Service = JsonErrors<S>;

    fn layer(&self, inner: S) -> Self::Service {
        JsonErrors { inner }
    }
}

/// The service of [`JsonErrorsLayer`].
#[derive(Clone)]
pub struct JsonErrors<S> {
    inner: S,
}

impl<S> Service<Request> for JsonErrors<S>
where
    S: Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = WithJsonError<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let method = request.method().clone();
        // A refcounted clone: the path is only formatted when the answer is an error.
        let uri = request.uri().clone();
        WithJsonError {
            answer: self.inner.call(request),
            asked: Some((method, uri)),
        }
    }
}

pin_project! {
    /// The answer of [`JsonErrors`]: the inner one, with a JSON body if it was a bodiless error.
    pub struct WithJsonError<F> {
        #[pin]
        answer: F,
        asked: Option<(Method, Uri)>,
    }
}

impl<F, E> Future for WithJsonError<F>
where
    F: Future<Output = Result<Response, E>>,
{
    type Output = Result<Response, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = ready!(this.answer.poll(cx))?;
        Poll::Ready(Ok(match this.asked.take() {
            Some((method, uri)) => with_body(response, &method, &uri),
            None => response,
        }))
    }
}

/// `response`, or a JSON error in its place when it is a bodiless error.
fn with_body(response: Response, method: &Method, uri: &Uri) -> Response {
    let status = response.status();
    let is_error = status.is_client_error() || status.is_server_error();
    let is_json = response.headers().get(header::CONTENT_TYPE)
        == Some(&HeaderValue::from_static("application/json"));
    let has_body = response.body().size_hint().exact() != Some(0);
    if !is_error || is_json || has_body {
        return response;
    }
    let path = uri.path();
    let detail = match status {
        StatusCode::METHOD_NOT_ALLOWED => format!("method {method} is not allowed on {path}"),
        StatusCode::NOT_FOUND => format!("no route for {method} {path}"),
        _ => format!(
            "{method} {path}: {}",
            status.canonical_reason().unwrap_or("error")
        ),
    };
    let (mut parts, _) = response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = serde_json::to_vec(&ErrorBody { detail }).unwrap_or_default();
    Response::from_parts(parts, Body::from(body))
}
