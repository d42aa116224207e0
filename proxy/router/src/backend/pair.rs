//! [`Pair`]: one dp rank of one prefill, what a request's P half is sent to.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use pd_protocol::Rank;
use reqwest::header::HeaderValue;

use super::{Backend, Call};

/// One dp rank of one prefill: what a request's P half is sent to.
pub struct Pair {
    /// The prefill server.
    pub backend: Arc<Backend>,
    /// Its bootstrap server (`remote_bootstrap_addr`), if it has one.
    pub bootstrap_addr: Option<Arc<str>>,
    /// The dp rank.
    pub dp_rank: Rank,
    /// The dp rank as the `X-data-parallel-rank` header value.
    pub rank_header: HeaderValue,
    /// The engine id of that dp rank (`remote_engine_id`), if its bootstrap server names one.
    pub engine_id: Option<Arc<str>>,
    /// `remote_bootstrap_addr` and `remote_engine_id` as D's `kv_transfer_params` carry them
    /// ([`crate::body::kv_source`]), when both are known.
    pub kv_source: Option<Box<str>>,
    /// The model the engine registered (`None` when its registration or its server does not
    /// say): only decodes that serve it are paired with it.
    pub model: Option<Arc<str>>,
    /// How many dp ranks the prefill has (SGLang's bootstrap rooms encode the rank modulo it).
    pub dp_size: Rank,
    pub(super) outstanding: AtomicUsize,
    /// Its engine is marked draining in the registry (learnt from the bootstrap server's watch).
    pub(super) draining: AtomicBool,
}

/// One discovered dp rank of a prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiscoveredRank<'a> {
    /// The dp rank.
    pub rank: Rank,
    /// Its engine id (none without a bootstrap server, or on SGLang's).
    pub engine_id: Option<&'a str>,
    /// The model its engine registered, if it did.
    pub model: Option<&'a str>,
    /// How many dp ranks the prefill has.
    pub dp_size: Rank,
}

/// The identity of dp rank `dp_rank` of the prefill whose backend identity is `backend_id`.
pub fn pair_id(backend_id: u64, dp_rank: Rank) -> u64 {
    backend_id ^ u64::from(dp_rank).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl Pair {
    /// A stable identity for the policies: the prefill's and the dp rank's.
    pub fn id(&self) -> u64 {
        pair_id(self.backend.id(), self.dp_rank)
    }

    /// Whether requests may be sent to this dp rank: its prefill is healthy, on prefill duty
    /// and drained neither at this proxy nor in the registry.
    pub fn takes_requests(&self) -> bool {
        self.backend.is_healthy()
            && !self.backend.is_drained()
            && self.backend.is_on_duty()
            && !self.draining.load(Ordering::Relaxed)
    }

    /// The load the policies see: P calls to this dp rank in flight through this proxy, or its
    /// share of what the prefill's engine reports, when that is more.
    pub fn load(&self) -> usize {
        let share = self.backend.engine_load().unwrap_or(0) / self.dp_size.max(1) as usize;
        self.outstanding().max(share)
    }

    /// Whether this dp rank may serve `model`: the model its engine registered, or one its
    /// prefill lists at `/v1/models` (adapters included); anything while neither is known.
    pub fn serves(&self, model: Option<&str>) -> bool {
        let Some(model) = model else { return true };
        match (self.model.as_deref(), self.backend.lists(model)) {
            (Some(registered), listed) => registered == model || listed == Some(true),
            (None, listed) => listed != Some(false),
        }
    }

    /// Whether its engine is marked draining in the registry.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// P calls to this dp rank not yet finished.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Starts a P call to this dp rank (counted on the pair and on the prefill).
    pub fn call(self: &Arc<Self>) -> Call {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        let mut call = self.backend.call();
        call.pair = Some(self.clone());
        call
    }
}
