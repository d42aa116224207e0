//! Request and transfer ids: random version-4 UUIDs without a system call each.

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use uuid::Uuid;

/// `X-Request-Id`: kept from the client or made up, sent to P and D and back to the client.
pub(crate) static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Random version-4 UUIDs (`Uuid::new_v4` asks the OS every time): SipHash, keyed once from the
/// OS, over a counter.
pub(crate) struct Ids {
    key: RandomState,
    counter: AtomicU64,
}

impl Default for Ids {
    fn default() -> Self {
        Ids {
            key: RandomState::new(),
            counter: AtomicU64::new(0),
        }
    }
}

impl Ids {
    /// The next id.
    pub(crate) fn next(&self) -> Uuid {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let high = u128::from(self.key.hash_one((n, 0u8)));
        let low = u128::from(self.key.hash_one((n, 1u8)));
        uuid::Builder::from_random_bytes(((high << 64) | low).to_be_bytes()).into_uuid()
    }

    /// The request's id: the client's non-empty `X-Request-Id`, or a new one.
    pub(crate) fn request_id(&self, headers: &HeaderMap) -> HeaderValue {
        headers
            .get(&X_REQUEST_ID)
            .filter(|value| !value.is_empty())
            .cloned()
            .unwrap_or_else(|| {
                let mut text = [0; uuid::fmt::Hyphenated::LENGTH];
                HeaderValue::from_bytes(self.next().hyphenated().encode_lower(&mut text).as_bytes())
                    .expect("a uuid is a valid header value")
            })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn ids_are_distinct_version_4_uuids() {
        let ids = Ids::default();
        let seen: HashSet<Uuid> = (0..10_000).map(|_| ids.next()).collect();
        assert_eq!(seen.len(), 10_000);
        for id in seen {
            assert_eq!(id.get_version(), Some(uuid::Version::Random));
            assert_eq!(id.get_variant(), uuid::Variant::RFC4122);
        }
        assert_ne!(Ids::default().next(), Ids::default().next());
    }
}
