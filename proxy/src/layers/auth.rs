//! The `--api-key` check: `Authorization: Bearer <key>` (the scheme in any case, the key compared
//! in constant time), or 401 in OpenAI's error shape.

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use pd_service::{Gate, GateLayer};

use super::track::TrackerSlot;
use crate::error::ApiError;
use crate::metrics::Outcome;
use crate::state::AppState;

/// Lets a request through when it carries the key (or none is configured).
#[derive(Clone)]
pub(crate) struct RequireApiKey(pub AppState);

impl RequireApiKey {
    /// The layer checking the key in front of a route.
    pub(crate) fn layer(state: &AppState) -> GateLayer<Self> {
        GateLayer(RequireApiKey(state.clone()))
    }
}

impl Gate for RequireApiKey {
    fn refusal(&self, request: &Request) -> Option<Response> {
        let admitted = self
            .0
            .api_key
            .as_ref()
            .is_none_or(|key| key.admits(request.headers()));
        if admitted {
            return None;
        }
        if let Some(mut tracker) = request
            .extensions()
            .get::<TrackerSlot>()
            .and_then(TrackerSlot::take)
        {
            tracker.finish(Outcome::Unauthorized);
        }
        Some(
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "this proxy needs the header Authorization: Bearer <key> with its --api-key",
            )
            .into_response(),
        )
    }
}
