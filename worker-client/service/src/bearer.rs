//! The one bearer-token check of every pd-bootstrap server: `Authorization: Bearer <token>`, the
//! scheme matched case-insensitively (RFC 9110 §11.1), the token compared in constant time.

use std::sync::Arc;

use axum::http::{header, HeaderMap};
use subtle::ConstantTimeEq;

/// A token clients must present as `Authorization: Bearer <token>`.
#[derive(Clone)]
pub struct BearerToken(Arc<[u8]>);

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken(<redacted>)")
    }
}

impl BearerToken {
    /// The token `token`; `None` when it is empty (an empty token would mean "no check").
    pub fn new(token: &str) -> Option<Self> {
        (!token.is_empty()).then(|| BearerToken(Arc::from(token.as_bytes())))
    }

    /// Whether `headers` carry this token. The comparison takes the same time whatever the
    /// presented bytes, so the token cannot be guessed by timing.
    pub fn admits(&self, headers: &HeaderMap) -> bool {
        self.matches(BearerToken::presented(headers).unwrap_or_default())
    }

    /// Whether `presented` is this token, compared in constant time (for a token sent in a
    /// header of its own).
    pub fn matches(&self, presented: &[u8]) -> bool {
        bool::from(presented.ct_eq(&self.0))
    }

    /// The token `headers` present as `Authorization: Bearer <token>`, if any.
    pub fn presented(headers: &HeaderMap) -> Option<&[u8]> {
        let value = headers.get(header::AUTHORIZATION)?.as_bytes();
        let (scheme, rest) = value.split_at_checked(7)?;
        scheme.eq_ignore_ascii_case(b"bearer ").then_some(rest)
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn with(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn the_scheme_is_case_insensitive_and_the_token_exact() {
        let token = BearerToken::new("s3cret").unwrap();
        for good in ["Bearer s3cret", "bearer s3cret", "BEARER s3cret"] {
            assert!(token.admits(&with(good)), "{good}");
        }
        for bad in [
            "Bearer S3cret",
            "Bearer s3cret ",
            "Basic s3cret",
            "s3cret",
            "Bearer",
            "",
        ] {
            assert!(!token.admits(&with(bad)), "{bad}");
        }
        assert!(!token.admits(&HeaderMap::new()));
        assert!(token.matches(b"s3cret") && !token.matches(b"s3cre") && !token.matches(b""));
        assert!(BearerToken::new("").is_none());
    }
}
