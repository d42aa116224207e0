//! What a client sees when the proxy itself fails a request: OpenAI's error shape
//! `{"error": {"message", "type", "code"}}` (what OpenAI client libraries parse), or, once an SSE
//! stream has begun, the same object as an SSE event followed by `data: [DONE]`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Serialize;

/// An error answer made by the proxy.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The OpenAI error type, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's `code` when it is a word (e.g. `model_not_found`); else the status.
    pub code: Option<&'static str>,
    /// The request field at fault (OpenAI's `param`).
    pub param: Option<&'static str>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    param: Option<&'a str>,
    code: Code<'a>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Code<'a> {
    Status(u16),
    Word(&'a str),
}

impl ApiError {
    /// An error with the given status, type and message.
    pub(crate) fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            code: None,
            param: None,
        }
    }

    /// The same error with OpenAI's `code` as a word.
    pub(crate) fn with_code(self, code: &'static str) -> Self {
        ApiError {
            code: Some(code),
            ..self
        }
    }

    /// The same error naming the request field at fault.
    pub(crate) fn with_param(self, param: &'static str) -> Self {
        ApiError {
            param: Some(param),
            ..self
        }
    }

    /// 503: nothing to send the request to.
    pub(crate) fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            message,
        )
    }

    /// 502: a backend failed.
    pub(crate) fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "upstream_error", message)
    }

    /// 504: a backend did not answer in time.
    pub(crate) fn gateway_timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout", message)
    }

    /// The JSON body.
    pub(crate) fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(&Envelope {
            error: Inner {
                message: &self.message,
                kind: self.kind,
                param: self.param,
                code: match self.code {
                    Some(word) => Code::Word(word),
                    None => Code::Status(self.status.as_u16()),
                },
            },
        })
        .expect("the error envelope serializes")
    }

    /// The error as the last events of an SSE stream: `data: {"error": ...}` then `data: [DONE]`.
    pub(crate) fn to_sse(&self) -> Bytes {
        let mut out = b"data: ".to_vec();
        out.extend_from_slice(&self.to_json());
        out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        Bytes::from(out)
    }
}

/// The body of the errors hyper answers before any route sees the request (400 malformed,
/// 414, 431), in OpenAI's shape (wired in through `pd_service::ServeLimits::wire_error_body`).
pub(crate) fn wire_error_body(code: u16, reason: &str) -> Vec<u8> {
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
    let message = match code {
        400 if reason == "Bad Request" => {
            "the request is not valid HTTP/1.1 (a malformed request line or header)".to_owned()
        }
        414 => "the request URI is too long".to_owned(),
        431 => "the request has too many headers or they are too large".to_owned(),
        _ => format!("{code} {reason}"),
    };
    ApiError::new(status, "invalid_request_error", message).to_json()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, self.to_json()).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_openai_like() {
        let err = ApiError::bad_gateway("P failed \"badly\"");
        let json: serde_json::Value = serde_json::from_slice(&err.to_json()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"error": {"message": "P failed \"badly\"", "type": "upstream_error", "code": 502}})
        );
        let sse = err.to_sse();
        let text = std::str::from_utf8(&sse).unwrap();
        assert!(text.starts_with("data: {\"error\":"));
        assert!(text.ends_with("\n\ndata: [DONE]\n\n"));
    }
}
