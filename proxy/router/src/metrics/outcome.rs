//! How each call to a backend ended: the `outcome` label of the backends' calls.

/// How one call to a backend ended (the `outcome` label of `backend_requests_total`, after the registry's prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallOutcome {
    /// A 2xx answer, read to its end.
    Ok,
    /// A non-2xx status.
    HttpError,
    /// No connection could be made.
    ConnectError,
    /// The time limit passed.
    Timeout,
    /// The connection broke or the answer was malformed.
    Error,
    /// The proxy dropped the call (client gone, or the other side failed).
    Cancelled,
}

impl CallOutcome {
    /// Every outcome, in label order.
    pub const ALL: [CallOutcome; 6] = [
        CallOutcome::Ok,
        CallOutcome::HttpError,
        CallOutcome::ConnectError,
        CallOutcome::Timeout,
        CallOutcome::Error,
        CallOutcome::Cancelled,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Ok => "ok",
            CallOutcome::HttpError => "http_error",
            CallOutcome::ConnectError => "connect_error",
            CallOutcome::Timeout => "timeout",
            CallOutcome::Error => "error",
            CallOutcome::Cancelled => "cancelled",
        }
    }
}
