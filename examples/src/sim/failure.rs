//! The answer of a request the simulated engine cannot serve.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// A request the engine cannot serve: the status and OpenAI error it answers with.
#[derive(Debug)]
pub struct Failure {
    status: StatusCode,
    kind: &'static str,
    message: String,
    /// The field at fault, vLLM's `param`.
    param: Option<String>,
    /// Whether `code` carries the status, as vLLM's `ErrorResponse` does (else null).
    numbered: bool,
}

impl Failure {
    /// The request itself is wrong (400 `invalid_request_error`).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Failure {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            numbered: false,
        }
    }

    /// P's KV could not be had (`kv_transfer_error` with `status`).
    pub fn kv(status: StatusCode, message: impl Into<String>) -> Self {
        Failure {
            status,
            kind: "kv_transfer_error",
            message: message.into(),
            param: None,
            numbered: false,
        }
    }

    /// vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code": status}}`.
    pub fn vllm(
        status: StatusCode,
        kind: &'static str,
        message: impl Into<String>,
        param: Option<String>,
    ) -> Self {
        Failure {
            status,
            kind,
            message: message.into(),
            param,
            numbered: true,
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The error's message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let code = self.numbered.then_some(self.status.as_u16());
        let body = json!({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": code,
        }});
        (self.status, Json(body)).into_response()
    }
}
