//! What can go wrong talking to a bootstrap server, and whether retrying can help.

use std::time::Duration;

/// A failed call to a bootstrap server. Every variant but [`ClientError::InvalidInput`] names the
/// URL it was talking to.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// An argument cannot be sent as given (e.g. a lease ttl out of range); nothing was sent.
    #[error("invalid input: {reason}")]
    InvalidInput {
        /// What is wrong, naming the argument.
        reason: String,
    },
    /// The URL given to the client is not an http(s) URL.
    #[error("invalid bootstrap URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No TCP connection could be made (server down, not started yet, wrong address).
    #[error("cannot connect to the bootstrap server at {url}: {reason}")]
    Connect {
        /// The URL called.
        url: String,
        /// The transport's explanation.
        reason: String,
    },
    /// The server did not answer in time.
    #[error("the bootstrap server at {url} did not answer within {timeout:?}")]
    Timeout {
        /// The URL called.
        url: String,
        /// The per-attempt timeout that fired.
        timeout: Duration,
    },
    /// The connection broke mid-call.
    #[error("the call to {url} failed: {reason}")]
    Transport {
        /// The URL called.
        url: String,
        /// The transport's explanation.
        reason: String,
    },
    /// The server answered 5xx (or 408/429): it may succeed later.
    #[error("the bootstrap server at {url} answered {status}: {detail}")]
    Unavailable {
        /// The URL called.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The server's `detail`.
        detail: String,
    },
    /// The server refused the call (4xx): a conflict or bad input; retrying cannot help.
    #[error("the bootstrap server at {url} refused the call ({status}): {detail}")]
    Rejected {
        /// The URL called.
        url: String,
        /// The HTTP status.
        status: u16,
        /// The server's `detail`, e.g. vLLM's "Engine ID mismatch ..." text.
        detail: String,
    },
    /// The answer was not the JSON the route promises.
    #[error("the bootstrap server at {url} sent an invalid answer: {reason}")]
    InvalidResponse {
        /// The URL called.
        url: String,
        /// What was wrong.
        reason: String,
    },
    /// Retries ran out of time; `last` is the last attempt's error.
    #[error("gave up on {url} after {attempts} attempts in {elapsed:?}; last error: {last}")]
    DeadlineExceeded {
        /// The URL called.
        url: String,
        /// How many attempts were made.
        attempts: u32,
        /// How long the retries took.
        elapsed: Duration,
        /// The last error seen.
        last: Box<ClientError>,
    },
    /// The bootstrap server does not know this engine, even after a fresh lookup.
    #[error("engine {engine_id} is not registered at the bootstrap server {url}")]
    UnknownEngine {
        /// The bootstrap server asked.
        url: String,
        /// The engine id looked for.
        engine_id: String,
    },
    /// The remote engine cannot work with this one: a field of its registered layout (model,
    /// KV dtype, block size, tp/pp size, protocol version) differs from ours.
    #[error(
        "engine {engine_id} at {url} is incompatible: its {field} is {remote}, ours is {local}"
    )]
    Incompatible {
        /// The bootstrap server asked.
        url: String,
        /// The remote engine.
        engine_id: String,
        /// The field that differs.
        field: &'static str,
        /// Our value.
        local: String,
        /// The remote engine's value.
        remote: String,
    },
}

impl ClientError {
    /// True when the same call may succeed if tried again later (connection failures, timeouts,
    /// 5xx, 503 "not ready"); false for conflicts, bad input and exhausted deadlines.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ClientError::Connect { .. }
                | ClientError::Timeout { .. }
                | ClientError::Transport { .. }
                | ClientError::Unavailable { .. }
        )
    }

    /// The HTTP status the server answered, if it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Unavailable { status, .. } | ClientError::Rejected { status, .. } => {
                Some(*status)
            }
            ClientError::DeadlineExceeded { last, .. } => last.status(),
            _ => None,
        }
    }
}
