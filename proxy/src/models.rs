//! `GET /v1/models`: the answer of a healthy decode, relayed.

use std::time::Duration;

use axum::extract::State;
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::metrics::CallOutcome;
use crate::routing::RequestInfo;
use crate::state::AppState;

/// `GET /v1/models`: the answer of a healthy decode.
pub async fn models(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let Some(decode) = state.pick_decode(None, None, &RequestInfo::empty()) else {
        return ApiError::unavailable(
            "no decode is ready: every decode is failing its health checks",
        )
        .into_response();
    };
    let call = decode.call();
    let mut request = state
        .upstream
        .client
        .get(decode.models_url.clone())
        .timeout(state.upstream.request_timeout.min(Duration::from_secs(30)));
    if let Some(authorization) = headers.get(AUTHORIZATION) {
        request = request.header(AUTHORIZATION, authorization.clone());
    }
    let answer = async {
        let response = request.send().await?;
        let status = response.status();
        let content_type = response.headers().get(CONTENT_TYPE).cloned();
        Ok::<_, reqwest::Error>((status, content_type, response.bytes().await?))
    }
    .await;
    match answer {
        Ok((status, content_type, body)) => {
            call.finish(if status.is_success() {
                CallOutcome::Ok
            } else {
                CallOutcome::HttpError
            });
            let mut response = (status, body).into_response();
            if let Some(content_type) = content_type {
                response.headers_mut().insert(CONTENT_TYPE, content_type);
            }
            response
        }
        Err(err) => {
            call.finish(if err.is_timeout() {
                CallOutcome::Timeout
            } else if err.is_connect() {
                CallOutcome::ConnectError
            } else {
                CallOutcome::Error
            });
            ApiError::bad_gateway(format!(
                "decode {}: {}",
                decode.url(),
                pd_service::error_chain(&err)
            ))
            .into_response()
        }
    }
}
