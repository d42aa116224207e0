//! How a client request, and each call to a backend, ended: the `outcome` labels.

/// How a client request ended (the `outcome` label of `pd_proxy_requests_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// D's answer was relayed to its end with a 2xx status.
    Ok,
    /// The body was not a JSON object, or too large.
    BadRequest,
    /// The client did not send its body in time.
    ClientTimeout,
    /// The API key was missing or wrong.
    Unauthorized,
    /// No ready (prefill, dp rank) pair or no healthy decode.
    Unavailable,
    /// No healthy decode serves the model of the chosen prefill.
    ModelMismatch,
    /// No engine serves the model asked for (404).
    ModelNotFound,
    /// P failed (connect error, bad status or broken body).
    PrefillError,
    /// P did not answer in time.
    PrefillTimeout,
    /// D failed, after the one retry.
    DecodeError,
    /// D did not answer in time.
    DecodeTimeout,
    /// D refused the request (4xx), relayed as is.
    DecodeRejected,
    /// D's stream broke after it had begun.
    StreamError,
    /// The client went away before the answer was complete.
    ClientDisconnected,
    /// Refused under overload (429): the admission queue, or latency targets no engine meets.
    Overloaded,
    /// Over its tenant's limits (429, `--api-keys-file`).
    RateLimited,
}

impl Outcome {
    /// Every outcome, in label order.
    pub(crate) const ALL: [Outcome; 16] = [
        Outcome::Ok,
        Outcome::BadRequest,
        Outcome::ClientTimeout,
        Outcome::Unauthorized,
        Outcome::Unavailable,
        Outcome::ModelMismatch,
        Outcome::ModelNotFound,
        Outcome::PrefillError,
        Outcome::PrefillTimeout,
        Outcome::DecodeError,
        Outcome::DecodeTimeout,
        Outcome::DecodeRejected,
        Outcome::StreamError,
        Outcome::ClientDisconnected,
        Outcome::Overloaded,
        Outcome::RateLimited,
    ];

    /// The label value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::BadRequest => "bad_request",
            Outcome::ClientTimeout => "client_timeout",
            Outcome::Unauthorized => "unauthorized",
            Outcome::Unavailable => "unavailable",
            Outcome::ModelMismatch => "model_mismatch",
            Outcome::ModelNotFound => "model_not_found",
            Outcome::PrefillError => "prefill_error",
            Outcome::PrefillTimeout => "prefill_timeout",
            Outcome::DecodeError => "decode_error",
            Outcome::DecodeTimeout => "decode_timeout",
            Outcome::DecodeRejected => "decode_rejected",
            Outcome::StreamError => "stream_error",
            Outcome::ClientDisconnected => "client_disconnected",
            Outcome::Overloaded => "overloaded",
            Outcome::RateLimited => "rate_limited",
        }
    }
}
