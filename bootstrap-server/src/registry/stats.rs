//! The registry's figures for `/metrics`: workers, engines, live request ids, the revision, the
//! store's connection, the topology's readiness, the workers leases took with them.

use std::sync::atomic::Ordering;

use pd_protocol::Revision;

use super::model::Readiness;
use super::Registry;
use crate::sync::lock;

/// Counts for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    /// Registered workers.
    pub workers: usize,
    /// Engines owning at least one dp rank.
    pub engines: usize,
    /// Live request ids.
    pub live_requests: usize,
    /// The revision of the registry's worker table.
    pub revision: Revision,
    /// Whether the store currently follows every change (an etcd watch can be down).
    pub store_connected: bool,
    /// Registered, expected and missing workers of the configured topology.
    pub readiness: Readiness,
    /// Workers removed because their lease ended (expired or revoked), since the start.
    pub lease_removals: u64,
}

impl Registry {
    /// Counts for `/metrics`.
    pub fn stats(&self) -> Stats {
        // Lock order everywhere: workers before requests (and never both through temporaries).
        let view = self.view();
        let revision = self.visible_revision(&self.read_workers());
        let live_requests = lock(&self.requests).len();
        let readiness = view.readiness();
        Stats {
            workers: readiness.registered,
            engines: view.engines(),
            live_requests,
            revision,
            store_connected: self.store.connected(),
            readiness,
            lease_removals: self.lease_removals.load(Ordering::Relaxed),
        }
    }
}
