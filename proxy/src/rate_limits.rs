//! The HTTP side of the tenants' limits (`pd_router::tenants`): the 429 a request over a limit
//! gets, and the `x-ratelimit-*` headers OpenAI's clients read, on the 429 and on every answer
//! of a tenant with limits (what a request is charged is `pd_router::tenants::charge`'s).

use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use pd_router::tenants::charge::{rate_headers, retry_after, Api};
use pd_router::tenants::{LimitKind, Limited, RateStatus};

use crate::error::ApiError;
use crate::route::Route;

/// `retry-after-ms`: OpenAI's clients wait this long before their retry.
static RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

/// The API of `route`, as the charge knows it.
pub(crate) fn api(route: Route) -> Api {
    match route {
        Route::Completions => Api::Completions,
        Route::ChatCompletions => Api::Chat,
        Route::Generate => Api::Generate,
    }
}

/// The 429 of a request over `limited`, its tenant `tenant`.
pub(crate) fn refusal(tenant: &str, limited: &Limited) -> Response {
    let kind = match limited.kind {
        LimitKind::Requests | LimitKind::Concurrency => "requests",
        LimitKind::PromptTokens | LimitKind::OutputTokens => "tokens",
    };
    let error = ApiError::new(StatusCode::TOO_MANY_REQUESTS, kind, limited.message(tenant))
        .with_code("rate_limit_exceeded");
    let mut response = error.into_response();
    let headers = response.headers_mut();
    if let Some(wait) = limited.retry_after {
        let (seconds, millis) = retry_after(wait);
        headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        headers.insert(RETRY_AFTER_MS.clone(), HeaderValue::from(millis));
    }
    insert_status(headers, &limited.status);
    response
}

/// Adds the `x-ratelimit-*` headers of `status`.
pub(crate) fn insert_status(headers: &mut HeaderMap, status: &RateStatus) {
    for (name, value) in rate_headers(status) {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(name), HeaderValue::try_from(value)) {
            headers.insert(name, value);
        }
    }
}
