//! The `--api-key` check: `Authorization: Bearer <key>` (the scheme in any case, the key compared
//! in constant time), or 401 in OpenAI's error shape.

use std::future::{ready, Ready};
use std::task::{Context, Poll};

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures_util::future::Either;
use tower::{Layer, Service};

use super::track::TrackerSlot;
use crate::error::ApiError;
use crate::metrics::Outcome;
use crate::state::AppState;

/// Layer: lets a request through when it carries the key (or none is configured).
#[derive(Clone)]
pub struct RequireApiKeyLayer(pub AppState);

impl<S> Layer<S> for RequireApiKeyLayer {
    type Service = RequireApiKey<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequireApiKey {
            inner,
            state: self.0.clone(),
        }
    }
}

/// The service of [`RequireApiKeyLayer`].
#[derive(Clone)]
pub struct RequireApiKey<S> {
    inner: S,
    state: AppState,
}

impl<S> Service<Request> for RequireApiKey<S>
where
    S: Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let admitted = self
            .state
            .api_key
            .as_ref()
            .is_none_or(|key| key.admits(request.headers()));
        if admitted {
            return Either::Left(self.inner.call(request));
        }
        if let Some(mut tracker) = request
            .extensions()
            .get::<TrackerSlot>()
            .and_then(TrackerSlot::take)
        {
            tracker.finish(Outcome::Unauthorized);
        }
        Either::Right(ready(Ok(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "this proxy needs the header Authorization: Bearer <key> with its --api-key",
        )
        .into_response())))
    }
}
