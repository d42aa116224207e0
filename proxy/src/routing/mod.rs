//! Choosing a backend: a [`Policy`] sees the candidates (whether each is usable, and its load)
//! and what the request is ([`RequestInfo`]), and picks one. One file per policy;
//! [`policy_for`] builds the one `--policy` names. A request-aware policy (cache-aware, session
//! affinity) is one more file here and one more `config::Policy` variant.

mod least_loaded;
mod request;
mod round_robin;

pub use least_loaded::LeastLoaded;
pub use request::RequestInfo;
pub use round_robin::RoundRobin;

use crate::config::Policy as PolicyName;

/// What a policy sees of the candidates, by index.
pub trait Candidates {
    /// How many there are.
    fn len(&self) -> usize;
    /// Whether candidate `i` may be chosen (healthy, not the one that just failed...).
    fn usable(&self, i: usize) -> bool;
    /// Candidate `i`'s load: requests outstanding through this proxy.
    fn load(&self, i: usize) -> usize;
    /// True when there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Chooses a backend for a request.
pub trait Policy: Send + Sync {
    /// The index of the candidate to use, or `None` when no candidate is usable.
    fn pick(&self, candidates: &dyn Candidates, request: &RequestInfo<'_>) -> Option<usize>;
}

/// The policy `name` (one instance per kind of choice: (prefill, dp rank) pairs, decodes).
pub fn policy_for(name: PolicyName) -> Box<dyn Policy> {
    match name {
        PolicyName::RoundRobin => Box::new(RoundRobin::default()),
        PolicyName::LeastLoaded => Box::new(LeastLoaded::default()),
    }
}

/// [`Candidates`] over a slice, with the usability and load of an item given by closures.
pub struct Slice<'a, T, U, L> {
    /// The items.
    pub items: &'a [T],
    /// Whether an item may be chosen.
    pub usable: U,
    /// An item's load.
    pub load: L,
}

impl<T, U: Fn(&T) -> bool, L: Fn(&T) -> usize> Candidates for Slice<'_, T, U, L> {
    fn len(&self) -> usize {
        self.items.len()
    }

    fn usable(&self, i: usize) -> bool {
        (self.usable)(&self.items[i])
    }

    fn load(&self, i: usize) -> usize {
        (self.load)(&self.items[i])
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
    }

    /// `n` usable candidates with the given loads (zero when `load` is shorter).
    pub fn fixed(n: usize, usable: impl Fn(usize) -> bool, load: &[usize]) -> Fixed {
        Fixed {
            usable: (0..n).map(usable).collect(),
            load: (0..n).map(|i| load.get(i).copied().unwrap_or(0)).collect(),
        }
    }
}
