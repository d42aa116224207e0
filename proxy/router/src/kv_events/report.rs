//! What `GET /admin/kv-index` shows: the index's size and, per engine followed, its
//! subscription's state and the blocks it holds.

use std::sync::atomic::Ordering;

use pd_protocol::Rank;
use serde::Serialize;

use super::KvTracker;
use crate::kv_index::EngineSlot;
use crate::sync::lock;

impl KvTracker {
    /// What `GET /admin/kv-index` shows.
    pub fn report(&self) -> KvIndexReport {
        let index = self.read_index();
        let stats = index.stats();
        let engines = lock(&self.engines)
            .iter()
            .enumerate()
            .filter_map(|(slot, e)| Some((slot, e.as_ref()?)))
            .map(|(slot, e)| EngineReport {
                role: e.backend.role().as_str(),
                backend: e.backend.url().to_owned(),
                dp_rank: e.source.dp_rank,
                endpoint: e.source.endpoint.clone(),
                replay: e.source.replay.clone(),
                connected: e.feed.connected.load(Ordering::Relaxed),
                blocks: index.engine_blocks(EngineSlot(slot as u32)),
                block_size: Some(e.feed.block_size.load(Ordering::Relaxed)).filter(|&b| b > 0),
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
    /// Tokens per block, from its events (none before its first block).
    pub block_size: Option<u32>,
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
