//! Consistent hash on a session key, with bounded load: the turns of one conversation go to the
//! same backend (whose prefix cache holds the conversation so far) while it is not overloaded.
//!
//! The key is what vLLM (0.33) takes as a request's session id, in its order: the body's
//! `session_id`, the `--session-header` header (`X-Session-ID`, vLLM's), `vllm_xargs.session_id`;
//! else the body's `user`. Each usable candidate gets
//! a score from the key and its identity (rendezvous hashing: adding or removing a backend moves
//! only the sessions it gains or held); the best-scored candidate whose load stays within the
//! load factor times the average takes the request. A request without a key goes to the least
//! loaded of two random candidates.

use std::hash::{BuildHasher, Hasher};

use super::least_loaded::LeastLoaded;
use super::settings::SessionConfig;
use super::{Candidates, Policy, RequestInfo};

/// The consistent-hash policy.
#[derive(Debug)]
pub struct ConsistentHash {
    config: SessionConfig,
    without_key: LeastLoaded,
}

impl ConsistentHash {
    /// The policy reading the session from `config.header` (else `user`).
    pub fn new(config: SessionConfig) -> Self {
        ConsistentHash {
            config,
            without_key: LeastLoaded::default(),
        }
    }

    /// The session key of `request`, if it has one.
    fn key(&self, request: &RequestInfo<'_>) -> Option<String> {
        (request.session_id(&self.config.header)).or_else(|| request.user())
    }

    /// The candidate for session `key`.
    pub fn pick_for_key(&self, candidates: &dyn Candidates, key: &str) -> Option<usize> {
        let state = foldhash::fast::FixedState::with_seed(0xc0ffee);
        let score = |i: usize| {
            let mut h = state.build_hasher();
            h.write(key.as_bytes());
            h.write_u64(candidates.id(i));
            h.finish()
        };
        let usable: Vec<usize> = (0..candidates.len())
            .filter(|&i| candidates.usable(i))
            .collect();
        let total: usize = usable.iter().map(|&i| candidates.load(i)).sum();
        // Bounded load: no candidate above factor x the average once this request is counted.
        let bound = ((total + 1) as f64 * self.config.load_factor / usable.len().max(1) as f64)
            .ceil() as usize;
        let best = |within: &dyn Fn(usize) -> bool| {
            usable
                .iter()
                .copied()
                .filter(|&i| within(i))
                .max_by_key(|&i| score(i))
        };
        best(&|i| candidates.load(i) < bound).or_else(|| best(&|_| true))
    }
}

impl Policy for ConsistentHash {
    fn pick(&self, candidates: &dyn Candidates, request: &RequestInfo<'_>) -> Option<usize> {
        match self.key(request) {
            Some(key) => self.pick_for_key(candidates, &key),
            None => self.without_key.pick(candidates, request),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::fixed;
    use super::*;
    use http::HeaderMap;

    fn policy() -> ConsistentHash {
        ConsistentHash::new(SessionConfig {
            header: "x-session-id".into(),
            load_factor: 1.25,
        })
    }

    #[test]
    fn a_session_stays_on_one_backend_and_sessions_spread() {
        let policy = policy();
        let all = fixed(4, |_| true, &[]);
        let mut counts = [0; 4];
        for session in 0..400 {
            let key = format!("session-{session}");
            let first = policy.pick_for_key(&all, &key).unwrap();
            for _ in 0..3 {
                assert_eq!(policy.pick_for_key(&all, &key), Some(first));
            }
            counts[first] += 1;
        }
        for count in counts {
            assert!((60..=140).contains(&count), "{counts:?}");
        }
    }

    #[test]
    fn only_the_sessions_of_a_removed_backend_move() {
        let policy = policy();
        let all = fixed(4, |_| true, &[]);
        let without_2 = fixed(4, |i| i != 2, &[]);
        for session in 0..200 {
            let key = format!("s{session}");
            let before = policy.pick_for_key(&all, &key).unwrap();
            let after = policy.pick_for_key(&without_2, &key).unwrap();
            assert!(
                before == 2 || before == after,
                "{key} moved from {before} to {after}"
            );
        }
    }

    #[test]
    fn an_overloaded_home_sends_the_session_elsewhere() {
        let policy = policy();
        let home = policy.pick_for_key(&fixed(2, |_| true, &[]), "s").unwrap();
        let mut loads = [1; 2];
        loads[home] = 10;
        assert_eq!(
            policy.pick_for_key(&fixed(2, |_| true, &loads), "s"),
            Some(1 - home)
        );
    }

    #[test]
    fn the_key_is_vllms_session_id_else_the_user() {
        let policy = policy();
        let body = crate::body::Body::parse(br#"{"user":"u1","prompt":"x"}"#).unwrap();
        let mut headers = HeaderMap::new();
        assert_eq!(
            policy.key(&RequestInfo::new(&body, &headers)).as_deref(),
            Some("u1")
        );
        headers.insert("x-session-id", "chat-9".parse().unwrap());
        assert_eq!(
            policy.key(&RequestInfo::new(&body, &headers)).as_deref(),
            Some("chat-9")
        );
        // vLLM 0.33's body field comes first, as vLLM reads it.
        let body = crate::body::Body::parse(br#"{"user":"u1","session_id":"s2"}"#).unwrap();
        assert_eq!(
            policy.key(&RequestInfo::new(&body, &headers)).as_deref(),
            Some("s2")
        );
        assert_eq!(policy.key(&RequestInfo::empty()), None);
    }
}
