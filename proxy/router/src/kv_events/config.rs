//! The `--kv-events` flags.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use pd_service::parse_seconds;

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
    /// The model's tokenizer directory (its `tokenizer.json`, and `tokenizer_config.json` or
    /// `chat_template.jinja` for chats): prompts are tokenized in-process, exactly as the
    /// engine does, for precise_prefix. Without it, the engines' own `POST /tokenize` is asked.
    #[arg(long, env = "PD_PROXY_TOKENIZER", value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Seconds an engine's `POST /tokenize` may take (without --tokenizer); past it the
    /// request is routed without its tokens.
    #[arg(long, env = "PD_PROXY_TOKENIZE_TIMEOUT", default_value = "1", value_parser = parse_seconds)]
    pub tokenize_timeout: Duration,
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
    /// `--tokenizer`.
    pub tokenizer: Option<PathBuf>,
    /// `--tokenize-timeout`.
    pub tokenize_timeout: Duration,
}

impl KvEventsArgs {
    /// The configuration, or `None` without `--kv-events` (turned on by `needed`: a policy
    /// routes on the events).
    pub fn config(&self, needed: bool) -> Option<KvEventsConfig> {
        (self.kv_events || needed).then(|| KvEventsConfig {
            port: self.kv_events_port,
            max_blocks: self.kv_index_max_blocks.max(1),
            rescan: Duration::from_secs(5),
            tokenizer: self.tokenizer.clone(),
            tokenize_timeout: self.tokenize_timeout,
        })
    }
}

impl Default for KvEventsConfig {
    /// The flags' defaults.
    fn default() -> Self {
        KvEventsConfig {
            port: None,
            max_blocks: 2_000_000,
            rescan: Duration::from_secs(5),
            tokenizer: None,
            tokenize_timeout: Duration::from_secs(1),
        }
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
