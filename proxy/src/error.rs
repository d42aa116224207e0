//! What a client sees when a request fails: OpenAI's error shape
//! `{"error": {"message", "type", "param", "code"}}` (what OpenAI client libraries parse), with
//! `param` the request field at fault or `null` and `code` a word or `null`, always; or, once an
//! SSE stream has begun, the same object as an SSE event followed by `data: [DONE]`. An engine's
//! own error answer is told in the same shape ([`ApiError::from_engine`]), and which engine
//! failed never reaches the client's body: it goes to the logs and, for operators, the
//! `x-pd-upstream` header (see `crate::handler`).

use std::borrow::Cow;

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
    /// OpenAI's `code`, a word (e.g. `model_not_found`), or `null`.
    pub code: Option<Cow<'static, str>>,
    /// The request field at fault (OpenAI's `param`), or `null`.
    pub param: Option<Cow<'static, str>>,
    /// Which engine failed (`prefill http://host:port (dp rank 1)`), for the logs and the
    /// operators' header only.
    pub upstream: Option<Box<str>>,
}

/// Which engine failed a request, on its error response (see [`ApiError::upstream`]).
#[derive(Debug, Clone)]
pub(crate) struct FailedUpstream(pub String);

#[derive(Serialize)]
struct Envelope<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
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
            upstream: None,
        }
    }

    /// The same error with OpenAI's `code` as a word.
    pub(crate) fn with_code(self, code: impl Into<Cow<'static, str>>) -> Self {
        ApiError {
            code: Some(code.into()),
            ..self
        }
    }

    /// The same error naming the request field at fault.
    pub(crate) fn with_param(self, param: impl Into<Cow<'static, str>>) -> Self {
        ApiError {
            param: Some(param.into()),
            ..self
        }
    }

    /// The same error, said to come from the engine `who` (logs and operators only).
    pub(crate) fn failed_at(self, who: String) -> Self {
        ApiError {
            upstream: Some(who.into()),
            ..self
        }
    }

    /// An engine's error answer (`status`, `body`) in the proxy's shape: the engine's message,
    /// and its `param` and word `code` when it gave them (vLLM's `{"error": {...}}`, its older
    /// `{"object": "error", ...}`, FastAPI's `{"detail": ...}`, or plain text); the type is
    /// OpenAI's `invalid_request_error` for a 4xx and `upstream_error` for the rest. `role`
    /// (`prefill` or `decode`) only words an empty message.
    pub(crate) fn from_engine(status: StatusCode, body: &[u8], role: &str) -> Self {
        let json = serde_json::from_slice::<serde_json::Value>(body).ok();
        let error = json.as_ref().map(|json| json.get("error").unwrap_or(json));
        let text = |value: &serde_json::Value| match value.as_str() {
            Some(text) => text.to_owned(),
            None => value.to_string(),
        };
        let message = error
            .and_then(|e| e.get("message").or_else(|| e.get("detail")))
            .map(text)
            .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_owned());
        let message = match message.is_empty() {
            true => format!("the {role} answered {status}"),
            false => message,
        };
        let word = |key: &str| {
            let value = error?.get(key)?.as_str()?;
            (!value.is_empty()).then(|| Cow::Owned(value.to_owned()))
        };
        let kind = match status.is_client_error() {
            true => "invalid_request_error",
            false => "upstream_error",
        };
        ApiError {
            code: word("code"),
            param: word("param"),
            ..Self::new(status, kind, message)
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
                param: self.param.as_deref(),
                code: self.code.as_deref(),
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
        if let Some(who) = self.upstream {
            response.extensions_mut().insert(FailedUpstream(who.into()));
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
            serde_json::json!({"error": {"message": "P failed \"badly\"", "type": "upstream_error", "param": null, "code": null}})
        );
        let sse = err.to_sse();
        let text = std::str::from_utf8(&sse).unwrap();
        assert!(text.starts_with("data: {\"error\":"));
        assert!(text.ends_with("\n\ndata: [DONE]\n\n"));
    }

    #[test]
    fn engines_errors_are_told_in_one_shape() {
        let shape = |status: u16, body: &str| {
            let err = ApiError::from_engine(
                StatusCode::from_u16(status).unwrap(),
                body.as_bytes(),
                "decode",
            );
            serde_json::from_slice::<serde_json::Value>(&err.to_json()).unwrap()["error"].clone()
        };
        let expected = serde_json::json!({"message": "bad temperature", "type": "invalid_request_error", "param": "temperature", "code": null});
        // vLLM's error, its older form, and FastAPI's: the same answer.
        for body in [
            r#"{"error": {"message": "bad temperature", "type": "BadRequestError", "param": "temperature", "code": 400}}"#,
            r#"{"object": "error", "message": "bad temperature", "type": "BadRequestError", "param": "temperature", "code": 400}"#,
        ] {
            assert_eq!(shape(400, body), expected, "{body}");
        }
        assert_eq!(
            shape(422, r#"{"detail": "bad temperature"}"#)["message"],
            "bad temperature"
        );
        let server = shape(500, "");
        assert_eq!(
            server["message"],
            "the decode answered 500 Internal Server Error"
        );
        assert_eq!(server["type"], "upstream_error");
        assert_eq!(
            shape(
                404,
                r#"{"error": {"message": "no", "code": "model_not_found"}}"#
            )["code"],
            "model_not_found"
        );
    }
}
