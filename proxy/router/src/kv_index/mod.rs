//! [`KvIndex`]: which engine holds which KV cache blocks, from the engines' own KV cache events
//! (vLLM's `BlockStored`, `BlockRemoved`, `AllBlocksCleared`, decoded by
//! `pd_protocol::kv_events`), and, for a tokenized prompt, how many leading blocks each engine
//! holds: precise prefix-cache routing. A pure data structure: no I/O, no locks, no clock.
//!
//! **Engines** are [`EngineSlot`]s the caller allocates, small and dense (per-engine tables and
//! the bitsets are sized by the largest slot; slots from [`KvIndexConfig::max_engines`] up are
//! ignored). Events of one engine must be applied in the engine's order; an engine that
//! restarted, skipped a sequence number without replay, stopped publishing or left is
//! [`KvIndex::clear_engine`]d.
//!
//! **Keys.** An engine's block hashes cannot be recomputed from a prompt in general (they
//! depend on its hash algorithm and seed, random per process for the fast ones, and on what
//! events leave out, such as an adapter's path), so every block gets the proxy's own key,
//! chained like vLLM's:
//! `key(i) = mix(key(i-1) or ROOT, token ids of block i, material(i))` (`keys.rs`: fixed
//! constants, the same in every replica). `material` is what vLLM mixes into a block's hash
//! besides tokens, as its events publish it (vLLM 0.32, `generate_block_hash_extra_keys` and
//! `to_event_extra_keys`): the event's `lora_name`, and the block's `extra_keys` entry, in which
//! vLLM lists, untagged and in this order, the LoRA name, `(mm_identifier, offset)` pairs, the
//! cache salt (first block only, when non-empty) and prompt-embedding digests. A request's
//! [`RequestKey`] produces the same: entry `(lora_name, cache_salt)` for block 0 and
//! `(lora_name,)` after, each item only when set, no entry when empty. Each engine maps its
//! hashes to keys, so `BlockRemoved` resolves; a `BlockStored`'s first block chains on the key
//! of its `parent_block_hash` (or `ROOT` without one), later blocks on the one before.
//!
//! **Matched:** text-only prompts, with or without a LoRA adapter (by name) and a cache salt,
//! against blocks of the same size (the caller passes the engines' `block_size`; the token count
//! is in the key). **Not matched:** blocks holding multimodal items or prompt embeddings (a
//! request key cannot name them: a multimodal prompt matches at most its blocks before its first
//! item); LoRA or salted requests on engines that publish no `extra_keys` (SGLang, vLLM before
//! them: the material differs), where, conversely, an unsalted request also matches salted
//! blocks (the salt is invisible: a cache miss, not a leak); blocks naming an adapter only by
//! the deprecated `lora_id` (they match no request). vLLM also hashes the adapter's path: an
//! adapter re-pointed to another path keeps its keys here. Blocks of KV cache groups other than
//! 0, and tokens beyond `block_hashes.len() * block_size`, are ignored; the medium (GPU, CPU) is
//! not distinguished: removal from either removes the pair. A stored block whose parent hash
//! this engine's map lacks (evicted here, or stored before the subscription) cannot be keyed: it
//! is orphaned, with the rest of its event. Partial-block entries (vLLM's `cache_partial_block`
//! announces them with a smaller `block_size`) are keyed at their own size and match no
//! full-block request. An engine holding one key under two of its hashes loses the key at the
//! first removal (under-reporting, never over-reporting).
//!
//! **Bounded memory.** At most [`KvIndexConfig::max_entries`] (engine, block) pairs. The pairs
//! form one recency list, ordered by the last `BlockStored` that named them (stored, or
//! confirmed: vLLM re-announces reused prefix blocks); a new pair arriving at the cap first
//! evicts the least recent one, whatever its engine (counted in [`Applied::evicted`] and
//! [`Stats::evictions`]). Per pair: a 32-byte slab entry, a 16-byte slot in its engine's table
//! and a 24-byte one in the key table (shared by every engine holding the key), in tables at
//! most 7/10 full that double as they fill but stop at the size the cap needs: about 100 bytes
//! a pair at the cap when no two engines share a block (less where they do), up to ~140 just
//! after a table doubled; [`KvIndex::stats`] reports the estimate. Nothing is allocated per
//! block once the tables have grown; keys held by more than three engines keep them in a
//! pooled bitset.
//!
//! **Speed** is memory latency: a block costs a cache miss or two in tables far larger than the
//! caches. Each table keeps key and value in one slot (one miss per lookup), a key's bitset is
//! found from its slot without another indirection, and both applying an event and matching a
//! prompt first prefetch (start loading, without waiting) what a group of blocks will read, so
//! that their misses overlap instead of following one another.
//!
//! Files: `keys.rs` the hashing, `ingest.rs` applying events, `entries.rs` the pairs and their
//! recency list, `table.rs` the hash tables, `holders.rs` the engines per key, `runs.rs` the
//! matching walk; `tests.rs`, `tests_vllm.rs`; `workload.rs` the traffic `pd-bench kv-index`
//! times it on (bench support, not API).

mod entries;
mod holders;
mod ingest;
mod keys;
mod runs;
mod table;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_vllm;
#[doc(hidden)]
pub mod workload;

use pd_protocol::kv_events::KvEvent;

use entries::Entries;
use holders::{Bitsets, Holders};
use runs::Runs;
use table::Table;

/// Blocks whose table slots `match_prefix` reads ahead at once.
const AHEAD: usize = 16;

/// An engine (a backend's data-parallel rank), numbered by the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EngineSlot(pub u32);

/// The index's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvIndexConfig {
    /// The most (engine, block) pairs held (at least 1); beyond, the least recent leave.
    pub max_entries: usize,
    /// Engine slots from this one up are ignored.
    pub max_engines: u32,
}

impl Default for KvIndexConfig {
    /// Two million pairs (about 200 MB at most), 4,096 engines.
    fn default() -> Self {
        KvIndexConfig {
            max_entries: 2_000_000,
            max_engines: 4096,
        }
    }
}

/// What one event did, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Blocks stored, or confirmed (already held).
    pub stored: usize,
    /// Blocks removed (by `BlockRemoved` or `AllBlocksCleared`).
    pub removed: usize,
    /// Blocks ignored: unknown hashes removed, other KV cache groups, missing tokens or extra
    /// keys, engine slots out of range.
    pub ignored: usize,
    /// Blocks stored after a parent this engine's map lacks.
    pub orphaned: usize,
    /// Pairs evicted to make room.
    pub evicted: usize,
}

/// The index's size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    /// (engine, block) pairs held.
    pub blocks: usize,
    /// Distinct block keys.
    pub keys: usize,
    /// Pairs per engine, for engines holding any, by slot.
    pub engines: Vec<(EngineSlot, usize)>,
    /// Estimated memory, in bytes.
    pub bytes: usize,
    /// Pairs evicted by the cap since the index was made.
    pub evictions: u64,
}

/// What besides its tokens names a request's blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestKey<'a> {
    /// The LoRA adapter's name (the request's `model` when it names an adapter).
    pub lora_name: Option<&'a str>,
    /// The request's `cache_salt`.
    pub cache_salt: Option<&'a str>,
}

/// The global block index; see the module documentation.
#[derive(Debug)]
pub struct KvIndex {
    max_entries: usize,
    max_engines: u32,
    entries: Entries,
    /// Per engine slot: the engine's hash (folded) -> its entry.
    engines: Vec<Table<u32>>,
    /// Per engine slot: the KV cache group whose blocks are indexed, the first that an event
    /// named full attention (none yet: group 0, as engines that name no kinds have one group).
    attention_groups: Vec<Option<u32>>,
    /// Block key -> the engines holding it.
    keys: Table<Holders>,
    bitsets: Bitsets,
    evictions: u64,
    /// The (engine hash, key) of each block of the event being stored (kept for its memory).
    batch: Vec<(u64, u64)>,
}

impl KvIndex {
    /// An empty index.
    pub fn new(config: KvIndexConfig) -> Self {
        let max_entries = config.max_entries.clamp(1, u32::MAX as usize - 1);
        KvIndex {
            max_entries,
            max_engines: config.max_engines,
            entries: Entries::new(max_entries),
            engines: Vec::new(),
            attention_groups: Vec::new(),
            keys: Table::new(max_entries),
            bitsets: Bitsets::default(),
            evictions: 0,
            batch: Vec::new(),
        }
    }

    /// Applies one event of `engine`.
    pub fn apply(&mut self, engine: EngineSlot, event: &KvEvent) -> Applied {
        match event {
            KvEvent::BlockStored(stored) => self.store(engine, stored),
            KvEvent::BlockRemoved(removed) => self.remove(engine, removed),
            KvEvent::AllBlocksCleared => Applied {
                removed: self.clear_engine(engine),
                ..Applied::default()
            },
            KvEvent::Unknown(_) => Applied::default(),
        }
    }

    /// Forgets every block of `engine`; how many there were.
    pub fn clear_engine(&mut self, engine: EngineSlot) -> usize {
        if let Some(group) = self.attention_groups.get_mut(engine.0 as usize) {
            // A restarted engine may name its groups anew.
            *group = None;
        }
        let Some(table) = self.engines.get_mut(engine.0 as usize) else {
            return 0;
        };
        let table = std::mem::replace(table, Table::new(self.max_entries));
        for id in table.values() {
            let entry = self.entries.remove(id);
            self.drop_holder(entry.key, entry.engine);
        }
        table.len()
    }

    /// For a prompt's `token_ids` cut into blocks of `block_size` (a trailing partial block
    /// does not count), each engine holding its first block and how many leading blocks in a
    /// row it holds; longest first.
    pub fn match_prefix(
        &self,
        key: &RequestKey<'_>,
        token_ids: &[u32],
        block_size: usize,
    ) -> Vec<(EngineSlot, usize)> {
        if block_size == 0 {
            return Vec::new();
        }
        let [first, rest] = keys::request_materials(key.lora_name, key.cache_salt);
        let mut blocks = token_ids.chunks_exact(block_size);
        let Some(tokens) = blocks.next() else {
            return Vec::new();
        };
        let mut parent = keys::block_key(keys::ROOT, tokens, first);
        let Some(holders) = self.keys.get(parent) else {
            return Vec::new();
        };
        let mut runs = Runs::start(holders.view(&self.bitsets), self.engines.len());
        // The other blocks by groups: their keys, then their slots and bitsets read ahead (the
        // cache misses of a group overlap), then the walk.
        let mut n = 1;
        let mut group = [(0, None); AHEAD];
        while !runs.is_done() {
            let mut m = 0;
            for tokens in blocks.by_ref().take(AHEAD) {
                parent = keys::block_key(parent, tokens, rest);
                group[m].0 = parent;
                m += 1;
            }
            if m == 0 {
                break;
            }
            group[..m]
                .iter()
                .for_each(|&(key, _)| self.keys.prefetch(key));
            for (key, holders) in &mut group[..m] {
                *holders = self.keys.get(*key);
                if let Some(h) = holders {
                    h.prefetch(&self.bitsets);
                }
            }
            for (_, holders) in &group[..m] {
                if runs.is_done() {
                    break;
                }
                runs.next(n, holders.as_ref().map(|h| h.view(&self.bitsets)));
                n += 1;
            }
        }
        runs.finish(n)
    }

    /// How many (engine, block) pairs the index holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the index holds no pair.
    pub fn is_empty(&self) -> bool {
        self.entries.len() == 0
    }

    /// How many blocks `engine` holds.
    pub fn engine_blocks(&self, engine: EngineSlot) -> usize {
        self.engines.get(engine.0 as usize).map_or(0, Table::len)
    }

    /// The index's size and memory.
    pub fn stats(&self) -> Stats {
        let engines = (self.engines.iter().enumerate())
            .filter(|(_, table)| table.len() > 0)
            .map(|(slot, table)| (EngineSlot(slot as u32), table.len()))
            .collect();
        let bytes = self.entries.bytes()
            + self.engines.iter().map(Table::bytes).sum::<usize>()
            + self.engines.capacity() * std::mem::size_of::<Table<u32>>()
            + self.keys.bytes()
            + self.bitsets.bytes();
        Stats {
            blocks: self.entries.len(),
            keys: self.keys.len(),
            engines,
            bytes,
            evictions: self.evictions,
        }
    }
}
