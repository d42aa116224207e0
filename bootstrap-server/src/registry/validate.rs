//! Checks of the values a registration may carry: ids, ranks, addresses and lease times. Every
//! refusal names the field, so a 4xx says what to fix.

use pd_protocol::{Rank, MAX_ADDR_LEN, MAX_ID_LEN, MAX_LEASE_TTL, MAX_RANK};

/// Why an id or address was refused; the text names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct FieldError {
    /// The offending field.
    pub field: &'static str,
    /// What is wrong with it.
    pub problem: String,
}

impl FieldError {
    fn new(field: &'static str, problem: impl Into<String>) -> Self {
        FieldError {
            field,
            problem: problem.into(),
        }
    }
}

/// Checks an engine id or request id: non-empty, at most [`MAX_ID_LEN`] bytes, no control characters.
pub fn validate_id(field: &'static str, value: &str) -> Result<(), FieldError> {
    if value.is_empty() {
        return Err(FieldError::new(field, "must not be empty"));
    }
    if value.len() > MAX_ID_LEN {
        return Err(FieldError::new(
            field,
            format!("is {} bytes long, the limit is {MAX_ID_LEN}", value.len()),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(FieldError::new(
            field,
            "must not contain control characters",
        ));
    }
    Ok(())
}

/// Checks a lease time to live: 1 to [`MAX_LEASE_TTL`] seconds.
pub fn validate_lease_ttl(field: &'static str, value: u32) -> Result<(), FieldError> {
    if value == 0 || value > MAX_LEASE_TTL {
        return Err(FieldError::new(
            field,
            format!("{value} is out of range (1 to {MAX_LEASE_TTL} seconds)"),
        ));
    }
    Ok(())
}

/// Checks a rank against [`MAX_RANK`].
pub fn validate_rank(field: &'static str, value: Rank) -> Result<(), FieldError> {
    if value > MAX_RANK {
        return Err(FieldError::new(
            field,
            format!("{value} is out of range (at most {MAX_RANK})"),
        ));
    }
    Ok(())
}

/// Checks a transfer address: `scheme://host:port[/path]` (e.g. `tcp://10.0.0.5:41231`) or
/// `host:port`, with a port in 1..=65535.
pub fn validate_addr(field: &'static str, value: &str) -> Result<(), FieldError> {
    if value.is_empty() {
        return Err(FieldError::new(field, "must not be empty"));
    }
    if value.len() > MAX_ADDR_LEN {
        return Err(FieldError::new(
            field,
            format!("is {} bytes long, the limit is {MAX_ADDR_LEN}", value.len()),
        ));
    }
    let unparsable = || {
        FieldError::new(
            field,
            format!("{value:?} is not an address of the form scheme://host:port or host:port"),
        )
    };
    let with_scheme;
    let url_text = if value.contains("://") {
        value
    } else {
        with_scheme = format!("tcp://{value}");
        &with_scheme
    };
    let url = url::Url::parse(url_text).map_err(|_| unparsable())?;
    match (url.host_str(), url.port()) {
        (Some(host), Some(port)) if !host.is_empty() && port != 0 => Ok(()),
        _ => Err(unparsable()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_checked() {
        assert!(validate_addr("addr", "tcp://10.0.0.5:41231").is_ok());
        assert!(validate_addr("addr", "tcp://[::1]:5000").is_ok());
        assert!(validate_addr("addr", "node-3:5000").is_ok());
        for bad in [
            "",
            "tcp://host",
            "nonsense",
            "tcp://:80",
            "host:0",
            "host:99999",
        ] {
            assert!(validate_addr("addr", bad).is_err(), "{bad:?} passed");
        }
    }

    #[test]
    fn ids_are_checked() {
        assert!(validate_id("engine_id", "e-1").is_ok());
        assert!(validate_id("engine_id", "").is_err());
        assert!(validate_id("engine_id", &"x".repeat(MAX_ID_LEN + 1)).is_err());
        assert!(validate_id("req_id", "a\nb").is_err());
    }
}
