//! The `--api-key` check: `Authorization: Bearer <key>` (the scheme in any case, the key compared
//! in constant time), or 401 in OpenAI's error shape.

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::track::TrackerSlot;
use crate::error::ApiError;
use crate::metrics::Outcome;
use crate::state::AppState;

/// Middleware: lets the request through when it carries the key (or none is configured).
pub async fn require_api_key(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if state
        .api_key
        .as_ref()
        .is_none_or(|key| key.admits(request.headers()))
    {
        return next.run(request).await;
    }
    if let Some(mut tracker) = request
        .extensions()
        .get::<TrackerSlot>()
        .and_then(TrackerSlot::take)
    {
        tracker.finish(Outcome::Unauthorized);
    }
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        "this proxy needs the header Authorization: Bearer <key> with its --api-key",
    )
    .into_response()
}
