//! Following the engines' own KV cache events (`--kv-events`): for every backend (P and D), a
//! watcher finds where each of its dp ranks publishes ([`sources`]) and a subscriber per rank
//! ([`subscriber`]) applies every batch, in sequence order, to one [`KvIndex`] of which engine
//! holds which prefix blocks. An engine that restarts, leaves a gap replay cannot fill, or
//! fails its health checks leaves the index at once; `GET /admin/kv-index` shows it all.

mod config;
mod sources;
mod subscriber;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use config::{KvEventsArgs, KvEventsConfig};
use pd_protocol::kv_events::EventBatch;
use pd_protocol::Rank;
use serde::Serialize;
pub use sources::Source;

use crate::backend::Backend;
use crate::kv_index::{EngineSlot, KvIndex};
use crate::metrics::KvMetrics;
use crate::sync::lock;

/// One engine (a backend's dp rank) whose events are followed.
struct Engine {
    backend: Arc<Backend>,
    source: Source,
    feed: Arc<Feed>,
    task: tokio::task::JoinHandle<()>,
}

/// What an engine's subscription has seen.
#[derive(Default)]
pub struct Feed {
    connected: AtomicBool,
    last_seq: AtomicI64,
    batches: AtomicU64,
    gaps_replayed: AtomicU64,
    gaps_dropped: AtomicU64,
    rebuilds: AtomicU64,
    malformed: AtomicU64,
}

impl Feed {
    fn connected(&self, connected: bool) {
        self.connected.store(connected, Ordering::Relaxed);
    }

    fn gap(&self, filled: bool) {
        let counter = if filled {
            &self.gaps_replayed
        } else {
            &self.gaps_dropped
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn malformed(&self) {
        self.malformed.fetch_add(1, Ordering::Relaxed);
    }
}

/// The index and the subscriptions feeding it.
pub struct KvTracker {
    index: Mutex<KvIndex>,
    engines: Mutex<Vec<Engine>>,
    metrics: KvMetrics,
    config: KvEventsConfig,
}

impl KvTracker {
    /// An empty index of at most `config.max_blocks` entries.
    pub fn new(config: KvEventsConfig, metrics: KvMetrics) -> Arc<Self> {
        Arc::new(KvTracker {
            index: Mutex::new(KvIndex::new(config.index())),
            engines: Mutex::new(Vec::new()),
            metrics,
            config,
        })
    }

    fn feed(&self, slot: EngineSlot) -> Arc<Feed> {
        lock(&self.engines)[slot.0 as usize].feed.clone()
    }

    /// Applies one batch (sequence `seq`) of the engine in `slot`.
    fn apply(&self, slot: EngineSlot, seq: u64, payload: &[u8]) {
        let feed = self.feed(slot);
        let Ok(batch) = EventBatch::decode(payload) else {
            feed.malformed();
            self.metrics.malformed.inc();
            return;
        };
        let mut index = lock(&self.index);
        for event in &batch.events {
            index.apply(slot, event);
        }
        self.metrics.blocks.set(index.len() as i64);
        drop(index);
        feed.last_seq.store(seq as i64, Ordering::Relaxed);
        feed.batches.fetch_add(1, Ordering::Relaxed);
        self.metrics.events.inc_by(batch.events.len() as u64);
    }

    /// Drops every entry of the engine in `slot` (it is rebuilt from the events that follow).
    fn rebuild(&self, slot: EngineSlot) {
        self.feed(slot).rebuilds.fetch_add(1, Ordering::Relaxed);
        self.metrics.rebuilds.inc();
        let mut index = lock(&self.index);
        index.clear_engine(slot);
        self.metrics.blocks.set(index.len() as i64);
    }

    /// Follows `source` of `backend`: the slot already following it, or a new subscription
    /// (replacing one of the same dp rank on another endpoint).
    fn follow(self: &Arc<Self>, backend: &Arc<Backend>, source: Source) {
        let mut engines = lock(&self.engines);
        let same_rank = engines
            .iter()
            .position(|e| Arc::ptr_eq(&e.backend, backend) && e.source.dp_rank == source.dp_rank);
        if let Some(slot) = same_rank {
            if engines[slot].source == source {
                return;
            }
            engines[slot].task.abort();
        }
        let slot = same_rank.unwrap_or(engines.len());
        let engine_slot = EngineSlot(slot as u32);
        tracing::info!(backend = backend.url(), dp_rank = source.dp_rank, endpoint = %source.endpoint, "following the engine's KV cache events");
        let feed = Arc::new(Feed {
            last_seq: AtomicI64::new(-1),
            ..Feed::default()
        });
        let task = tokio::spawn(subscriber::follow(
            self.clone(),
            engine_slot,
            source.clone(),
        ));
        let engine = Engine {
            backend: backend.clone(),
            source,
            feed,
            task,
        };
        let replaced = slot < engines.len();
        if replaced {
            engines[slot] = engine;
        } else {
            engines.push(engine);
        }
        self.metrics.engines.set(engines.len() as i64);
        drop(engines);
        if replaced {
            self.rebuild(engine_slot);
        }
    }

    /// Drops the entries of every engine of `backend` (it failed its health checks).
    fn forget(&self, backend: &Arc<Backend>) {
        let slots: Vec<EngineSlot> = lock(&self.engines)
            .iter()
            .enumerate()
            .filter(|(_, e)| Arc::ptr_eq(&e.backend, backend))
            .map(|(slot, _)| EngineSlot(slot as u32))
            .collect();
        for slot in slots {
            self.rebuild(slot);
        }
    }

    /// What `GET /admin/kv-index` shows.
    pub fn report(&self) -> KvIndexReport {
        let index = lock(&self.index);
        let stats = index.stats();
        let engines = lock(&self.engines)
            .iter()
            .enumerate()
            .map(|(slot, e)| EngineReport {
                role: e.backend.role().as_str(),
                backend: e.backend.url().to_owned(),
                dp_rank: e.source.dp_rank,
                endpoint: e.source.endpoint.clone(),
                replay: e.source.replay.clone(),
                connected: e.feed.connected.load(Ordering::Relaxed),
                blocks: index.engine_blocks(EngineSlot(slot as u32)),
                last_seq: Some(e.feed.last_seq.load(Ordering::Relaxed)).filter(|s| *s >= 0),
                batches: e.feed.batches.load(Ordering::Relaxed),
                gaps_replayed: e.feed.gaps_replayed.load(Ordering::Relaxed),
                gaps_dropped: e.feed.gaps_dropped.load(Ordering::Relaxed),
                rebuilds: e.feed.rebuilds.load(Ordering::Relaxed),
                malformed: e.feed.malformed.load(Ordering::Relaxed),
            })
            .collect();
        KvIndexReport {
            blocks: stats.blocks,
            bytes: stats.bytes,
            max_blocks: self.config.max_blocks,
            evictions: stats.evictions,
            engines,
        }
    }
}

/// The answer of `GET /admin/kv-index`.
#[derive(Debug, Serialize)]
pub struct KvIndexReport {
    /// (engine, block) entries held.
    pub blocks: usize,
    /// Their estimated memory.
    pub bytes: usize,
    /// The cap on entries (`--kv-index-max-blocks`).
    pub max_blocks: usize,
    /// Entries dropped to stay under the cap.
    pub evictions: u64,
    /// Every engine followed.
    pub engines: Vec<EngineReport>,
}

/// One engine in [`KvIndexReport`].
#[derive(Debug, Serialize)]
pub struct EngineReport {
    /// `prefill` or `decode`.
    pub role: &'static str,
    /// The backend's URL.
    pub backend: String,
    /// The dp rank.
    pub dp_rank: Rank,
    /// Its PUB socket.
    pub endpoint: String,
    /// Its replay socket.
    pub replay: Option<String>,
    /// Subscribed now.
    pub connected: bool,
    /// Blocks it holds, as far as its events tell.
    pub blocks: usize,
    /// The last sequence number applied.
    pub last_seq: Option<i64>,
    /// Batches applied.
    pub batches: u64,
    /// Gaps filled from its replay socket.
    pub gaps_replayed: u64,
    /// Gaps that dropped its entries (no replay, or it could not fill them).
    pub gaps_dropped: u64,
    /// Times its entries were dropped: a gap, a restart, a failed health check.
    pub rebuilds: u64,
    /// Messages that could not be decoded.
    pub malformed: u64,
}

/// Watches `backend` forever: while it is healthy, asks where its dp ranks publish (every
/// `config.rescan`) and follows each; when it fails its health checks, drops its entries.
pub async fn watch_backend(
    tracker: Arc<KvTracker>,
    backend: Arc<Backend>,
    client: reqwest::Client,
    timeout: Duration,
) {
    let mut was_healthy = true;
    loop {
        let healthy = backend.is_healthy();
        if !healthy && was_healthy {
            tracker.forget(&backend);
        }
        was_healthy = healthy;
        if healthy {
            let base = reqwest::Url::parse(&format!("{}/", backend.url()));
            if let Ok(base) = base {
                let port = tracker.config.port;
                if let Some(sources) = sources::find(&client, &base, port, timeout).await {
                    for source in sources {
                        tracker.follow(&backend, source);
                    }
                }
            }
        }
        tokio::time::sleep(tracker.config.rescan).await;
    }
}
