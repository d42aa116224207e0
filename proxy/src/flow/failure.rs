//! What a failed call to P or D means for the client.

use std::sync::Arc;

use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::metrics::Outcome;
use crate::relay::Failure;
use crate::upstream::UpstreamError;
use pd_router::admission::class::ClassError;
use pd_router::admission::Shed;
use pd_router::backend::{Backend, Pair};

/// A request that ended before D's answer could be relayed: the answer and how it is counted.
pub(crate) struct Refusal {
    /// What the client gets.
    pub response: Box<Response>,
    /// How the request is counted.
    pub outcome: Outcome,
    /// The decode that failed after the prefill answered: a fresh placement (prefill
    /// included) that avoids it may still serve the request.
    pub replaceable: Option<Arc<Backend>>,
}

impl From<Failure> for Refusal {
    fn from((error, outcome): Failure) -> Self {
        Refusal {
            response: Box::new(error.into_response()),
            outcome,
            replaceable: None,
        }
    }
}

/// How an engine's failures are counted, by role.
struct Outcomes {
    /// It did not answer in time.
    timed_out: Outcome,
    /// It failed (a 5xx, unreachable, broken off).
    failed: Outcome,
    /// It refused the request (a 4xx).
    rejected: Outcome,
}

const PREFILL: Outcomes = Outcomes {
    timed_out: Outcome::PrefillTimeout,
    failed: Outcome::PrefillError,
    rejected: Outcome::PrefillError,
};

const DECODE: Outcomes = Outcomes {
    timed_out: Outcome::DecodeTimeout,
    failed: Outcome::DecodeError,
    rejected: Outcome::DecodeRejected,
};

/// What P's failure means for the client: its own error answer told in the proxy's shape, the
/// same whichever engine failed (the engine is named for operators only).
pub(super) fn prefill_failure(pair: &Pair, err: &UpstreamError) -> Failure {
    let who = format!("prefill {} (dp rank {})", pair.backend.url(), pair.dp_rank);
    let (error, outcome) = engine_failure("prefill", err, &PREFILL);
    (error.failed_at(format!("{who}: {err}")), outcome)
}

/// What D's failure means for the client: as P's ([`prefill_failure`]).
pub(super) fn decode_refusal(decode: &Backend, err: UpstreamError) -> Refusal {
    let who = format!("decode {}", decode.url());
    let (error, outcome) = match &err {
        UpstreamError::FirstByteTimeout(limit) => (
            ApiError::gateway_timeout(format!(
                "the decode sent nothing within {limit:?} of the prefill's answer \
                 (--decode-first-byte-timeout); it was not retried"
            )),
            Outcome::DecodeTimeout,
        ),
        _ => engine_failure("decode", &err, &DECODE),
    };
    Refusal::from((error.failed_at(format!("{who}: {err}")), outcome))
}

/// What the `role` engine's failure `err` tells the client, counted as `outcomes` say.
fn engine_failure(role: &str, err: &UpstreamError, outcomes: &Outcomes) -> Failure {
    match err {
        UpstreamError::Timeout(limit)
        | UpstreamError::FirstByteTimeout(limit)
        | UpstreamError::Stalled(limit) => (
            ApiError::gateway_timeout(format!("the {role} did not answer within {limit:?}")),
            outcomes.timed_out,
        ),
        UpstreamError::Status { status, body, .. } => {
            let outcome = match status.is_client_error() {
                true => outcomes.rejected,
                false => outcomes.failed,
            };
            (ApiError::from_engine(*status, body, role), outcome)
        }
        UpstreamError::Connect(_) => (
            ApiError::bad_gateway(format!("the {role} could not be reached")),
            outcomes.failed,
        ),
        UpstreamError::Broken(_) => (
            ApiError::bad_gateway(format!("the {role}'s answer broke off")),
            outcomes.failed,
        ),
    }
}

/// 429 in OpenAI's shape with `Retry-After`: refused under overload.
pub(super) fn overloaded(shed: &Shed) -> Refusal {
    let error = ApiError::new(
        StatusCode::TOO_MANY_REQUESTS,
        "server_overloaded",
        shed.message(),
    )
    .with_code(shed.reason.as_str());
    let mut response = error.into_response();
    response
        .headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(shed.retry_after_secs()));
    Refusal {
        response: Box::new(response),
        outcome: Outcome::Overloaded,
        replaceable: None,
    }
}

/// 400: a header that says something it cannot mean (a priority, a latency target).
pub(super) fn bad_class(err: &ClassError) -> Refusal {
    let error = ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        err.to_string(),
    )
    .with_param(err.header);
    Refusal::from((error, Outcome::BadRequest))
}

/// 503: no backend to send the request to.
pub(super) fn unavailable(message: &str) -> Refusal {
    Refusal::from((ApiError::unavailable(message), Outcome::Unavailable))
}

/// A refusal with `status` and an OpenAI-shaped error of `kind`.
pub(super) fn refused(
    status: StatusCode,
    kind: &'static str,
    message: String,
    outcome: Outcome,
) -> Refusal {
    Refusal::from((ApiError::new(status, kind, message), outcome))
}

/// No decode can take the request.
pub(super) fn no_decode() -> Refusal {
    unavailable("no decode is ready: every decode is failing its health checks (see GET /ready)")
}

/// No prefill can take the request (`none_discovered`: none has been discovered at all).
pub(super) fn no_prefill(none_discovered: bool) -> Refusal {
    unavailable(if none_discovered {
        "no prefill is ready: no (prefill, dp rank) pair has been discovered yet \
         (waiting for each prefill's /health and its bootstrap server's /query; see GET /ready)"
    } else {
        "no prefill is ready: every prefill with discovered dp ranks is failing its \
         health checks (see GET /ready)"
    })
}
