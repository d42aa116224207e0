//! Following the engines' own KV cache events (`--kv-events`): for every backend (P and D), a
//! watcher finds where each of its dp ranks publishes ([`sources`]) and a subscriber per rank
//! ([`subscriber`]) applies every batch, in sequence order, to one [`KvIndex`] of which engine
//! holds which prefix blocks. An engine that restarts, leaves a gap replay cannot fill, or
//! fails its health checks leaves the index at once; `GET /admin/kv-index` shows it all.

pub mod config;
mod holders;
mod report;
mod sources;
mod subscriber;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard};
use std::time::Duration;

pub use config::{KvEventsArgs, KvEventsConfig};
pub use holders::Held;
use pd_protocol::kv_events::{EventBatch, KvEvent};
pub use report::{EngineReport, KvIndexReport};
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
    /// Tokens per block, from the engine's `BlockStored` events (0 before the first).
    block_size: AtomicU32,
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
    index: RwLock<KvIndex>,
    /// By slot; a removed backend's slots are vacant until a new subscription takes them.
    engines: Mutex<Vec<Option<Engine>>>,
    metrics: KvMetrics,
    config: KvEventsConfig,
}

impl KvTracker {
    /// An empty index of at most `config.max_blocks` entries.
    pub fn new(config: KvEventsConfig, metrics: KvMetrics) -> Arc<Self> {
        Arc::new(KvTracker {
            index: RwLock::new(KvIndex::new(config.index())),
            engines: Mutex::new(Vec::new()),
            metrics,
            config,
        })
    }

    /// Its configuration.
    pub fn config(&self) -> &KvEventsConfig {
        &self.config
    }

    /// The counter of `precise_prefix` picks for `choice` and `reason`.
    pub fn pick_counter(&self, choice: &str, reason: &str) -> prometheus::IntCounter {
        self.metrics.picks.with_label_values(&[choice, reason])
    }

    fn read_index(&self) -> RwLockReadGuard<'_, KvIndex> {
        self.index.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_index(&self) -> std::sync::RwLockWriteGuard<'_, KvIndex> {
        self.index.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// The feed of the engine in `slot` (a vacant slot's: a fresh one nothing reads).
    fn feed(&self, slot: EngineSlot) -> Arc<Feed> {
        match &lock(&self.engines)[slot.0 as usize] {
            Some(engine) => engine.feed.clone(),
            None => Arc::default(),
        }
    }

    /// Applies one batch (sequence `seq`) of the engine in `slot`.
    fn apply(&self, slot: EngineSlot, seq: u64, payload: &[u8]) {
        let feed = self.feed(slot);
        let Ok(batch) = EventBatch::decode(payload) else {
            feed.malformed();
            self.metrics.malformed.inc();
            return;
        };
        if let Some(KvEvent::BlockStored(stored)) = batch
            .events
            .iter()
            .rev()
            .find(|e| matches!(e, KvEvent::BlockStored(_)))
        {
            feed.block_size.store(stored.block_size, Ordering::Relaxed);
        }
        let mut index = self.write_index();
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
        let mut index = self.write_index();
        index.clear_engine(slot);
        self.metrics.blocks.set(index.len() as i64);
    }

    /// Follows `source` of `backend`: the slot already following it, or a new subscription
    /// (replacing one of the same dp rank on another endpoint).
    fn follow(self: &Arc<Self>, backend: &Arc<Backend>, source: Source) {
        let mut engines = lock(&self.engines);
        let same_rank = engines.iter().position(|e| {
            e.as_ref().is_some_and(|e| {
                Arc::ptr_eq(&e.backend, backend) && e.source.dp_rank == source.dp_rank
            })
        });
        if let Some(engine) = same_rank.and_then(|slot| engines[slot].as_ref()) {
            if engine.source == source {
                return;
            }
            engine.task.abort();
        }
        let vacant = engines.iter().position(Option::is_none);
        let slot = same_rank.or(vacant).unwrap_or(engines.len());
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
            engines[slot] = Some(engine);
        } else {
            engines.push(Some(engine));
        }
        self.metrics
            .engines
            .set(engines.iter().flatten().count() as i64);
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
            .filter(|(_, e)| e.as_ref().is_some_and(|e| Arc::ptr_eq(&e.backend, backend)))
            .map(|(slot, _)| EngineSlot(slot as u32))
            .collect();
        for slot in slots {
            self.rebuild(slot);
        }
    }

    /// Stops following `backend` (it left the proxy's backends): its subscriptions end, its
    /// entries leave the index and its slots are free for other engines.
    pub fn remove(&self, backend: &Arc<Backend>) {
        let mut engines = lock(&self.engines);
        let mut freed = Vec::new();
        for (slot, entry) in engines.iter_mut().enumerate() {
            if entry
                .as_ref()
                .is_some_and(|e| Arc::ptr_eq(&e.backend, backend))
            {
                if let Some(engine) = entry.take() {
                    engine.task.abort();
                }
                freed.push(EngineSlot(slot as u32));
            }
        }
        self.metrics
            .engines
            .set(engines.iter().flatten().count() as i64);
        drop(engines);
        let mut index = self.write_index();
        for slot in freed {
            index.clear_engine(slot);
        }
        self.metrics.blocks.set(index.len() as i64);
    }
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
