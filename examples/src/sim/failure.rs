//! The answer of a request the simulated engine cannot serve.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::api::error_body;

/// A request the engine cannot serve: the status and OpenAI error it answers with.
#[derive(Debug)]
pub struct Failure {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl Failure {
    /// The request itself is wrong (400 `invalid_request_error`).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Failure {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
        }
    }

    /// P's KV could not be had (`kv_transfer_error` with `status`).
    pub fn kv(status: StatusCode, message: impl Into<String>) -> Self {
        Failure {
            status,
            kind: "kv_transfer_error",
            message: message.into(),
        }
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (self.status, Json(error_body(&self.message, self.kind))).into_response()
    }
}
