//! Command-line values and error text: durations in seconds, and an error with its causes.

use std::time::Duration;

/// Parses a positive number of seconds, fractions allowed (`"960"`, `"0.5"`), for duration flags.
pub fn parse_seconds(text: &str) -> Result<Duration, String> {
    match parse_seconds_or_zero(text)? {
        d if d.is_zero() => Err(format!("{text:?} must be a positive number of seconds")),
        d => Ok(d),
    }
}

/// Parses a non-negative number of seconds, fractions allowed; `"0"` is allowed.
pub fn parse_seconds_or_zero(text: &str) -> Result<Duration, String> {
    let seconds: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number of seconds"))?;
    if !(seconds.is_finite() && (0.0..1e9).contains(&seconds)) {
        return Err(format!(
            "{text:?} must be a number of seconds from 0 to 1e9"
        ));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// An error and its sources on one line (a transport's top-level message alone hides the cause).
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_are_parsed() {
        assert_eq!(parse_seconds("1.5"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_seconds_or_zero("0"), Ok(Duration::ZERO));
        for bad in ["0", "-1", "soon", "inf", "NaN", "1e12"] {
            assert!(parse_seconds(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[derive(Debug, thiserror::Error)]
    #[error("error sending request")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn error_chains_name_every_cause() {
        let outer = Outer(std::io::Error::other("connection refused"));
        assert_eq!(
            error_chain(&outer),
            "error sending request: connection refused"
        );
    }
}
