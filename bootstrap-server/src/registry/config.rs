//! The registry's settings: the expected topology, request-id limits and the engine-conflict
//! policy.

use std::time::Duration;

use pd_protocol::Rank;

use super::EngineConflictPolicy;

/// The P deployment's expected shape; `GET /query` answers 503 until every rank has registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpectedTopology {
    /// Number of dp ranks.
    pub dp_size: Rank,
    /// Number of tp ranks per dp rank.
    pub tp_size: Rank,
    /// Number of pp ranks per tp rank.
    pub pp_size: Rank,
}

impl ExpectedTopology {
    /// How many workers make the topology complete.
    pub fn worker_count(&self) -> usize {
        self.dp_size as usize * self.tp_size as usize * self.pp_size as usize
    }
}

/// Registry settings.
#[derive(Debug, Clone)]
pub struct RegistryConfig {
    /// The expected topology, if the operator configured one.
    pub expected: Option<ExpectedTopology>,
    /// How long a request id lives after registration.
    pub request_ttl: Duration,
    /// How long a bootstrap room (SGLang) lives after registration.
    pub room_ttl: Duration,
    /// The most live request ids held at once.
    pub max_requests: usize,
    /// What a new engine id for an owned dp rank does.
    pub engine_conflict: EngineConflictPolicy,
    /// Without a configured tp size: how long a dp group's whole grid of ranks must stay
    /// unchanged before `GET /query` shows it (see [`super::publication`]).
    pub settle: Duration,
}

impl Default for RegistryConfig {
    fn default() -> Self {
        RegistryConfig {
            expected: None,
            request_ttl: Duration::from_secs(960),
            room_ttl: Duration::from_secs(120),
            max_requests: 2_000_000,
            engine_conflict: EngineConflictPolicy::Replace,
            settle: Duration::from_secs(2),
        }
    }
}
