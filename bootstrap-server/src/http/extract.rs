//! A JSON body extractor whose rejections are [`ApiError`]s naming the offending field.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use super::error::ApiError;

/// Like `axum::Json`, but accepts any content type (clients such as `curl -d` send form types)
/// and answers bad bodies with `{"detail": ...}`: 400 for broken JSON, 422 for a missing or
/// mistyped field (the text names its path), 413 for a body over the limit.
pub struct JsonBody<T>(pub T);

impl<T, S> FromRequest<S> for JsonBody<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|rejection| ApiError::new(rejection.status(), rejection.body_text()))?;
        // serde_json alone first: axum's extractor tracks every field's path as it goes (5% of
        // a registration's instructions), which only a rejection needs.
        if let Ok(value) = serde_json::from_slice(&bytes) {
            return Ok(JsonBody(value));
        }
        match axum::Json::<T>::from_bytes(&bytes) {
            Ok(axum::Json(value)) => Ok(JsonBody(value)),
            Err(rejection) => Err(ApiError::new(rejection.status(), rejection.body_text())),
        }
    }
}
