//! Choosing a backend: a [`Policy`] sees the candidates (whether each is usable, its load and
//! its identity) and what the request is ([`RequestInfo`]), and picks one. One file per policy;
//! [`policy_for`] builds the one a flag names, [`settings`] holds the flags, [`decision`] decides
//! whether a request goes through P at all.

mod cache_aware;
mod consistent_hash;
pub mod decision;
mod least_loaded;
mod precise_prefix;
mod prefix_index;
pub mod queued_work;
mod request;
mod round_robin;
pub mod settings;

pub use cache_aware::CacheAware;
pub use consistent_hash::ConsistentHash;
pub use least_loaded::LeastLoaded;
pub use precise_prefix::{Choice, PickNote, PickReason, PrecisePrefix};
pub use request::RequestInfo;
pub use round_robin::RoundRobin;

use std::sync::Arc;

use settings::{Policy as PolicyName, RoutingConfig};

use crate::kv_events::KvTracker;

/// What a policy sees of the candidates, by index.
pub trait Candidates {
    /// How many there are.
    fn len(&self) -> usize;
    /// Whether candidate `i` may be chosen (healthy, not the one that just failed...).
    fn usable(&self, i: usize) -> bool;
    /// Candidate `i`'s load: requests outstanding through this proxy.
    fn load(&self, i: usize) -> usize;
    /// Candidate `i`'s identity: the same backend keeps it while candidates come and go.
    fn id(&self, i: usize) -> u64;
    /// True when there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Chooses a backend for a request.
pub trait Policy: Send + Sync {
    /// The index of the candidate to use, or `None` when no candidate is usable.
    fn pick(&self, candidates: &dyn Candidates, request: &RequestInfo<'_>) -> Option<usize>;

    /// The share of the request's prompt (0 to 1) the best-placed usable candidate already
    /// holds, for policies that know (cache-aware); `None` for the others.
    fn prefix_match(
        &self,
        _candidates: &dyn Candidates,
        _request: &RequestInfo<'_>,
    ) -> Option<f64> {
        None
    }
}

/// The policy `name` with `config`'s knobs, for `choice` ((prefill, dp rank) pairs, or
/// decodes); `kv` is the index precise_prefix reads (without one it is cache_aware).
pub fn policy_for(
    name: PolicyName,
    config: &RoutingConfig,
    choice: Choice,
    kv: Option<&Arc<KvTracker>>,
) -> Box<dyn Policy> {
    match (name, kv) {
        (PolicyName::RoundRobin, _) => Box::new(RoundRobin::default()),
        (PolicyName::LeastLoaded, _) => Box::new(LeastLoaded::default()),
        (PolicyName::PrecisePrefix, Some(kv)) => Box::new(PrecisePrefix::new(
            kv.clone(),
            choice,
            config.kv_load_weight,
            CacheAware::new(config.cache),
        )),
        (PolicyName::CacheAware | PolicyName::PrecisePrefix, _) => {
            Box::new(CacheAware::new(config.cache))
        }
        (PolicyName::ConsistentHash, _) => Box::new(ConsistentHash::new(config.session.clone())),
    }
}

/// [`Candidates`] over a slice, with the usability, load and identity of an item given by
/// closures.
pub struct Slice<'a, T, U, L, I> {
    /// The items.
    pub items: &'a [T],
    /// Whether an item may be chosen.
    pub usable: U,
    /// An item's load.
    pub load: L,
    /// An item's identity.
    pub id: I,
}

impl<T, U, L, I> Candidates for Slice<'_, T, U, L, I>
where
    U: Fn(&T) -> bool,
    L: Fn(&T) -> usize,
    I: Fn(&T) -> u64,
{
    fn len(&self) -> usize {
        self.items.len()
    }

    fn usable(&self, i: usize) -> bool {
        (self.usable)(&self.items[i])
    }

    fn load(&self, i: usize) -> usize {
        (self.load)(&self.items[i])
    }

    fn id(&self, i: usize) -> u64 {
        (self.id)(&self.items[i])
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    /// Candidates with fixed usability and load.
    pub struct Fixed {
        pub usable: Vec<bool>,
        pub load: Vec<usize>,
    }

    impl Candidates for Fixed {
        fn len(&self) -> usize {
            self.usable.len()
        }
        fn usable(&self, i: usize) -> bool {
            self.usable[i]
        }
        fn load(&self, i: usize) -> usize {
            self.load[i]
        }
        fn id(&self, i: usize) -> u64 {
            i as u64 + 1000
        }
    }

    /// `n` usable candidates with the given loads (zero when `load` is shorter).
    pub fn fixed(n: usize, usable: impl Fn(usize) -> bool, load: &[usize]) -> Fixed {
        Fixed {
            usable: (0..n).map(usable).collect(),
            load: (0..n).map(|i| load.get(i).copied().unwrap_or(0)).collect(),
        }
    }
}
