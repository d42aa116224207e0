//! The `--kv-events` flags.

use std::time::Duration;

use clap::Args;

use crate::kv_index::KvIndexConfig;

/// The KV-event flags, flattened into pd-proxy's.
#[derive(Debug, Clone, Args)]
pub struct KvEventsArgs {
    /// Follow every backend's KV cache events (vLLM's and SGLang's `--kv-events-config`) into
    /// an index of which engine holds which prefix blocks (`GET /admin/kv-index`). Where each
    /// engine publishes is read from its `GET /kv_event_sources` (vLLM), else
    /// `--kv-events-port`.
    #[arg(long, env = "PD_PROXY_KV_EVENTS")]
    pub kv_events: bool,
    /// The port engines that do not answer `/kv_event_sources` publish on (on their own host).
    #[arg(long, env = "PD_PROXY_KV_EVENTS_PORT")]
    pub kv_events_port: Option<u16>,
    /// The most (engine, block) entries the index holds; past it the least recently stored
    /// go first.
    #[arg(
        long,
        env = "PD_PROXY_KV_INDEX_MAX_BLOCKS",
        default_value_t = 2_000_000
    )]
    pub kv_index_max_blocks: usize,
}

/// What [`KvEventsArgs`] configure, when `--kv-events` is on.
#[derive(Debug, Clone)]
pub struct KvEventsConfig {
    /// `--kv-events-port`.
    pub port: Option<u16>,
    /// `--kv-index-max-blocks`.
    pub max_blocks: usize,
    /// How often each backend is asked where it publishes.
    pub rescan: Duration,
}

impl KvEventsArgs {
    /// The configuration, or `None` without `--kv-events`.
    pub fn config(&self) -> Option<KvEventsConfig> {
        self.kv_events.then(|| KvEventsConfig {
            port: self.kv_events_port,
            max_blocks: self.kv_index_max_blocks.max(1),
            rescan: Duration::from_secs(5),
        })
    }
}

impl KvEventsConfig {
    /// The index's settings.
    pub fn index(&self) -> KvIndexConfig {
        KvIndexConfig {
            max_entries: self.max_blocks,
            ..KvIndexConfig::default()
        }
    }
}
