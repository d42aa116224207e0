//! Applying `BlockStored` and `BlockRemoved` to the index.
//!
//! In an index far larger than the caches, each block costs a cache miss in its engine's table
//! and one in the key table, and each eviction or removal as many again and its pair's: memory
//! latency, not computation, is the price. So an event's blocks go in passes: the first ones
//! only compute keys and start loading (prefetch) what the next pass reads, for every block of
//! the event at once, so that their misses overlap; the last one applies the blocks, finding
//! their slots in the cache. Storing: the keys, then the table slots the blocks (and the pairs
//! they will evict) need, then the puts. Removing: the engine's table slots, then the pairs,
//! then their key slots and recency-list neighbours, then the removals.

use pd_protocol::kv_events::{BlockRemoved, BlockStored};

use super::holders::Holders;
use super::table::Table;
use super::{keys, Applied, EngineSlot, KvIndex};

impl KvIndex {
    /// `BlockStored`: keys the blocks (chained on the parent's) and puts them. Only full
    /// attention's blocks are a cached prefix (a sliding window's or a mamba state's are not),
    /// and of one group per engine: the first an event names full attention, else group 0.
    pub(super) fn store(&mut self, engine: EngineSlot, stored: &BlockStored) -> Applied {
        let n = stored.block_hashes.len();
        let mut applied = Applied::default();
        let bs = stored.block_size as usize;
        if engine.0 >= self.max_engines || !stored.is_full_attention() || bs == 0 {
            applied.ignored = n;
            return applied;
        }
        let slot = engine.0 as usize;
        if self.engines.len() <= slot {
            let max_entries = self.max_entries;
            self.engines
                .resize_with(slot + 1, || Table::new(max_entries));
            self.attention_groups.resize(slot + 1, None);
        }
        let group = stored.group_idx.unwrap_or(0);
        let indexed = match (&mut self.attention_groups[slot], &stored.kv_cache_spec_kind) {
            (known @ None, Some(_)) => *known.insert(group),
            (known, _) => known.unwrap_or(0),
        };
        if group != indexed {
            applied.ignored = n;
            return applied;
        }
        let mut parent = match &stored.parent_block_hash {
            None => keys::ROOT,
            Some(hash) => match self.engines[slot].get(keys::engine_hash(hash)) {
                Some(id) => self.entries.get(id).key,
                None => {
                    applied.orphaned = n;
                    return applied;
                }
            },
        };
        let lora = keys::Lora::of_event(stored.lora_name.as_deref(), stored.lora_id);
        let with_extra = !stored.extra_keys.is_empty();
        let mut batch = std::mem::take(&mut self.batch);
        batch.clear();
        let blocks = stored.token_ids.chunks_exact(bs).zip(&stored.block_hashes);
        for (i, (tokens, hash)) in blocks.enumerate() {
            let entry = match stored.extra_keys.get(i) {
                Some(entry) => entry.as_deref(),
                None if with_extra => break,
                None => None,
            };
            parent = keys::block_key(parent, tokens, lora.with_entry(entry));
            batch.push((keys::engine_hash(hash), parent));
        }
        self.prefetch_store(slot, &batch);
        for &(hash, key) in &batch {
            applied.evicted += self.put(engine.0, hash, key);
        }
        applied.stored = batch.len();
        applied.ignored = n - applied.stored;
        self.batch = batch;
        applied
    }

    /// `BlockRemoved`: drops the pairs of the hashes this engine has.
    pub(super) fn remove(&mut self, engine: EngineSlot, removed: &BlockRemoved) -> Applied {
        let n = removed.block_hashes.len();
        let mut applied = Applied::default();
        let slot = engine.0 as usize;
        let indexed = self.attention_groups.get(slot).copied().flatten();
        if slot >= self.engines.len() || removed.group_idx.unwrap_or(0) != indexed.unwrap_or(0) {
            applied.ignored = n;
            return applied;
        }
        // Each pass starts the cache misses the next one needs: the engine's table slots, the
        // pairs, then the pairs' key slots and their neighbours in the recency list.
        let table = &self.engines[slot];
        let hashes = || removed.block_hashes.iter().map(keys::engine_hash);
        hashes().for_each(|hash| table.prefetch(hash));
        let ids = || hashes().filter_map(|hash| table.get(hash));
        ids().for_each(|id| self.entries.prefetch(id));
        for id in ids() {
            self.keys.prefetch(self.entries.get(id).key);
            self.entries.prefetch_neighbours(id);
        }
        for hash in &removed.block_hashes {
            match self.engines[slot].get(keys::engine_hash(hash)) {
                Some(id) => {
                    self.remove_entry(id);
                    applied.removed += 1;
                }
                None => applied.ignored += 1,
            }
        }
        applied
    }

    /// Reads ahead the slots that storing `batch` for engine `slot` will touch: each block's in
    /// the engine's table and the key table, and those of the pairs it may evict.
    fn prefetch_store(&self, slot: usize, batch: &[(u64, u64)]) {
        let table = &self.engines[slot];
        for &(hash, key) in batch {
            table.prefetch(hash);
            self.keys.prefetch(key);
        }
        let evictions = (self.entries.len() + batch.len()).saturating_sub(self.max_entries);
        for entry in self.entries.oldest_first().take(evictions) {
            if let Some(table) = self.engines.get(entry.engine as usize) {
                table.prefetch(entry.hash);
            }
            self.keys.prefetch(entry.key);
        }
    }

    /// Records that `engine` holds `key` under its `hash` (stored or confirmed, so now the most
    /// recent); the pairs evicted to make room.
    fn put(&mut self, engine: u32, hash: u64, key: u64) -> usize {
        if let Some(id) = self.engines[engine as usize].get(hash) {
            let old = self.entries.get(id).key;
            if old != key {
                self.drop_holder(old, engine);
                self.add_holder(key, engine);
            }
            self.entries.touch(id, key);
            return 0;
        }
        let mut evicted = 0;
        while self.entries.len() >= self.max_entries {
            let Some(oldest) = self.entries.oldest() else {
                break;
            };
            self.remove_entry(oldest);
            evicted += 1;
        }
        self.evictions += evicted as u64;
        let id = self.entries.insert(key, hash, engine);
        self.engines[engine as usize].insert(hash, id);
        self.add_holder(key, engine);
        evicted
    }

    /// Drops pair `id` from the slab, its engine's table and its key's holders.
    pub(super) fn remove_entry(&mut self, id: u32) {
        let entry = self.entries.remove(id);
        if let Some(table) = self.engines.get_mut(entry.engine as usize) {
            table.remove(entry.hash);
        }
        self.drop_holder(entry.key, entry.engine);
    }

    /// Records `engine` among `key`'s holders.
    fn add_holder(&mut self, key: u64, engine: u32) {
        (self.keys.get_or_insert_with(key, || Holders::one(engine)))
            .insert(engine, &mut self.bitsets);
    }

    /// Drops `engine` from `key`'s holders (the key goes with its last holder).
    pub(super) fn drop_holder(&mut self, key: u64, engine: u32) {
        let bitsets = &mut self.bitsets;
        self.keys
            .modify(key, |holders| holders.remove(engine, bitsets));
    }
}
