//! The exceptions the binding raises: one class per kind of [`ClientError`], with the server's
//! message and, where there is one, its HTTP status.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use worker_client::ClientError;

create_exception!(
    pd_bootstrap,
    PdBootstrapError,
    PyException,
    "Base of every error pd_bootstrap raises. Attributes: `url` (the server, or None), `status` \
     (its HTTP status, or None), `detail` (its message, or None), `retryable` (whether trying \
     again later can succeed)."
);
create_exception!(
    pd_bootstrap,
    Unavailable,
    PdBootstrapError,
    "The server could not be reached or answered 5xx/503/408/429: retryable."
);
create_exception!(
    pd_bootstrap,
    Timeout,
    PdBootstrapError,
    "The server did not answer in time, or retries ran out of their deadline."
);
create_exception!(
    pd_bootstrap,
    Rejected,
    PdBootstrapError,
    "The server refused the call (4xx): not retryable as is."
);
create_exception!(
    pd_bootstrap,
    Unauthorized,
    Rejected,
    "The server refused the call for its credentials (401) or origin (403)."
);
create_exception!(
    pd_bootstrap,
    NotFound,
    PdBootstrapError,
    "What was asked for is not registered (an unknown engine id, or a 404)."
);
create_exception!(
    pd_bootstrap,
    Incompatible,
    PdBootstrapError,
    "A remote engine's registered layout differs from this one's. Attributes: `field`, \
     `local`, `remote`."
);
create_exception!(
    pd_bootstrap,
    InvalidInput,
    PdBootstrapError,
    "An argument cannot be sent as given (a bad URL, a lease ttl out of range); nothing was sent."
);
create_exception!(
    pd_bootstrap,
    ProtocolError,
    PdBootstrapError,
    "The server's answer was not what the protocol says."
);
create_exception!(
    pd_bootstrap,
    ForkError,
    PdBootstrapError,
    "The binding or this object was used in a child forked after the parent used it."
);

/// The Python exception for `err`, its attributes set.
pub fn to_py(err: &ClientError) -> PyErr {
    let root = root_cause(err);
    let py_err = match root {
        ClientError::InvalidInput { .. } | ClientError::InvalidUrl { .. } => {
            InvalidInput::new_err(err.to_string())
        }
        ClientError::Connect { .. }
        | ClientError::Transport { .. }
        | ClientError::Unavailable { .. } => Unavailable::new_err(err.to_string()),
        ClientError::Timeout { .. } => Timeout::new_err(err.to_string()),
        ClientError::Rejected {
            status: 401 | 403, ..
        } => Unauthorized::new_err(err.to_string()),
        ClientError::Rejected { status: 404, .. } | ClientError::UnknownEngine { .. } => {
            NotFound::new_err(err.to_string())
        }
        ClientError::Rejected { .. } => Rejected::new_err(err.to_string()),
        ClientError::InvalidResponse { .. } => ProtocolError::new_err(err.to_string()),
        ClientError::Incompatible { .. } => Incompatible::new_err(err.to_string()),
        ClientError::DeadlineExceeded { .. } => Timeout::new_err(err.to_string()),
    };
    Python::attach(|py| {
        let value = py_err.value(py);
        let (url, detail) = match root {
            ClientError::InvalidInput { .. } => (None, None),
            ClientError::InvalidUrl { url, .. }
            | ClientError::Connect { url, .. }
            | ClientError::Timeout { url, .. }
            | ClientError::Transport { url, .. }
            | ClientError::InvalidResponse { url, .. }
            | ClientError::DeadlineExceeded { url, .. }
            | ClientError::UnknownEngine { url, .. }
            | ClientError::Incompatible { url, .. } => (Some(url.clone()), None),
            ClientError::Unavailable { url, detail, .. }
            | ClientError::Rejected { url, detail, .. } => {
                (Some(url.clone()), Some(detail.clone()))
            }
        };
        // Setting an attribute on a fresh exception instance cannot fail.
        let _ = value.setattr("url", url);
        let _ = value.setattr("detail", detail);
        let _ = value.setattr("status", err.status());
        let _ = value.setattr("retryable", err.is_retryable());
        if let ClientError::Incompatible {
            field,
            local,
            remote,
            ..
        } = root
        {
            let _ = value.setattr("field", *field);
            let _ = value.setattr("local", local.as_str());
            let _ = value.setattr("remote", remote.as_str());
        }
    });
    py_err
}

/// What a retried call finally failed with: the last error of an exhausted deadline, unless
/// that was a timeout (then the deadline itself is the cause).
fn root_cause(err: &ClientError) -> &ClientError {
    match err {
        ClientError::DeadlineExceeded { last, .. }
            if !matches!(**last, ClientError::Timeout { .. }) =>
        {
            root_cause(last)
        }
        other => other,
    }
}

/// Adds every exception class to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("PdBootstrapError", py.get_type::<PdBootstrapError>())?;
    m.add("Unavailable", py.get_type::<Unavailable>())?;
    m.add("Timeout", py.get_type::<Timeout>())?;
    m.add("Rejected", py.get_type::<Rejected>())?;
    m.add("Unauthorized", py.get_type::<Unauthorized>())?;
    m.add("NotFound", py.get_type::<NotFound>())?;
    m.add("Incompatible", py.get_type::<Incompatible>())?;
    m.add("InvalidInput", py.get_type::<InvalidInput>())?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    m.add("ForkError", py.get_type::<ForkError>())?;
    Ok(())
}
