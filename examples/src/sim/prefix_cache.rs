//! A model of an engine's prefix cache (vLLM's automatic prefix caching, SGLang's radix cache):
//! a prompt's token ids are cut into blocks of [`BLOCK_TOKENS`], each named by a hash chained
//! over its parent's hash, its token ids and what vLLM mixes in besides, each tagged with what it
//! is (the LoRA adapter's name and path, and the cache salt in the first block), seeded randomly
//! per process as vLLM's fast hashes are; the engine keeps the most recently used blocks up to its capacity. The leading
//! blocks of a prompt found there are not computed again, so its prefill time shrinks with
//! them; KV pulled from a prefill lands in the cache too, as in a real decode. Queried and hit
//! tokens are counted as vLLM counts them (`prefix_cache_queries`, `prefix_cache_hits`).
//!
//! Every change is published as KV cache events when the cache has a [`Sink`]: the blocks
//! stored (from the first one not cached on), the blocks evicted to make room, a reset.

use std::hash::{BuildHasher, Hasher};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use foldhash::fast::FixedState;
use lru::LruCache;

use super::kv_events::{Batch, Sink, StoredBlock};
use super::lora::Adapter;

/// Tokens per cached block (vLLM's default block size).
pub const BLOCK_TOKENS: usize = 16;

/// A prompt as the cache names its blocks.
#[derive(Debug, Clone, Copy)]
pub struct PromptBlocks<'a> {
    /// The token ids.
    pub tokens: &'a [u32],
    /// The LoRA adapter it is computed with.
    pub lora: Option<&'a Adapter>,
    /// The request's `cache_salt` (an empty one is none, as vLLM tests its truthiness).
    pub cache_salt: Option<&'a str>,
}

impl PromptBlocks<'_> {
    /// The salt block `index` mixes in: the first block's, when not empty.
    fn salt(&self, index: usize) -> Option<&str> {
        self.cache_salt.filter(|s| !s.is_empty() && index == 0)
    }

    /// What block `index`'s hash mixes in besides tokens, as vLLM lists it in events
    /// (`to_event_extra_keys`: untagged, the adapter without its path): the LoRA name, then
    /// (first block only) the cache salt; `None` when nothing.
    fn extra_keys(&self, index: usize) -> Option<Vec<&str>> {
        let lora = self.lora.map(|lora| lora.name.as_str());
        let keys: Vec<&str> = lora.into_iter().chain(self.salt(index)).collect();
        (!keys.is_empty()).then_some(keys)
    }
}

/// The cached blocks, the hit counters, and where changes are published.
pub struct PrefixCache {
    blocks: Mutex<LruCache<u64, ()>>,
    seed: FixedState,
    events: Option<Sink>,
    /// Prompt tokens looked up.
    pub queries: AtomicU64,
    /// Of those, tokens found cached.
    pub hits: AtomicU64,
}

impl PrefixCache {
    /// A cache of `capacity` blocks, publishing its changes to `events`.
    pub fn new(capacity: NonZeroUsize, events: Option<Sink>) -> Self {
        PrefixCache {
            blocks: Mutex::new(LruCache::new(capacity)),
            seed: FixedState::with_seed(uuid::Uuid::new_v4().as_u64_pair().0),
            events,
            queries: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        }
    }

    fn blocks(&self) -> std::sync::MutexGuard<'_, LruCache<u64, ()>> {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The chain hashes of the prompt's whole blocks, in order.
    fn hashes(&self, prompt: &PromptBlocks<'_>) -> Vec<u64> {
        let mut parent: Option<u64> = None;
        let blocks = prompt.tokens.chunks_exact(BLOCK_TOKENS).enumerate();
        // Each value ends with a byte no UTF-8 text has, after a tag saying what it is, as vLLM
        // hashes `("lora", name, path)` and `("cache_salt", salt)`.
        let text = |h: &mut foldhash::fast::FoldHasher, value: &str| {
            h.write(value.as_bytes());
            h.write_u8(0xff);
        };
        blocks
            .map(|(index, tokens)| {
                let mut h = self.seed.build_hasher();
                h.write_u64(parent.map_or(0, |p| p ^ 1 << 63));
                tokens.iter().for_each(|&t| h.write_u32(t));
                if let Some(lora) = prompt.lora {
                    h.write_u8(1);
                    text(&mut h, &lora.name);
                    text(&mut h, &lora.path);
                }
                if let Some(salt) = prompt.salt(index) {
                    h.write_u8(2);
                    text(&mut h, salt);
                }
                let hash = h.finish();
                parent = Some(hash);
                hash
            })
            .collect()
    }

    /// Computing `prompt`: how many of its tokens were cached (counted as a query and its
    /// hits); all its whole blocks are cached afterwards.
    pub fn compute(&self, prompt: PromptBlocks<'_>) -> u32 {
        let tokens = prompt.tokens.len() as u32;
        let cached = self.insert(prompt);
        let hit = ((cached * BLOCK_TOKENS) as u32).min(tokens);
        self.queries.fetch_add(u64::from(tokens), Ordering::Relaxed);
        self.hits.fetch_add(u64::from(hit), Ordering::Relaxed);
        hit
    }

    /// Caches `prompt`'s blocks without counting a query (KV that arrived from a prefill).
    pub fn store(&self, prompt: PromptBlocks<'_>) {
        self.insert(prompt);
    }

    /// Drops every block (`POST /reset_prefix_cache`).
    pub fn clear(&self) {
        let mut cache = self.blocks();
        cache.clear();
        let mut batch = Batch::default();
        batch.cleared();
        self.publish(batch);
    }

    /// Caches the prompt's blocks from the first one not cached on (the leading cached ones
    /// just become the most recent, the first block the most recent of all): room is made first by evicting blocks of other prompts,
    /// least recently used first, as a real engine frees blocks before it computes. The
    /// events are published under the lock, so they leave in the order the cache changed.
    /// Returns how many leading blocks were cached.
    fn insert(&self, prompt: PromptBlocks<'_>) -> usize {
        let hashes = self.hashes(&prompt);
        let mut cache = self.blocks();
        let present = hashes.iter().filter(|&&h| cache.promote(&h)).count();
        let cached = hashes.iter().take_while(|&&h| cache.contains(&h)).count();
        let mut batch = Batch::default();
        let missing = hashes.len() - present;
        let free = cache.cap().get() - cache.len();
        let others = cache.len() - present;
        for _ in 0..missing.saturating_sub(free).min(others) {
            if let Some((evicted, ())) = cache.pop_lru() {
                batch.removed(evicted);
            }
        }
        for (index, &hash) in hashes.iter().enumerate().skip(cached) {
            if let Some((evicted, ())) = cache.push(hash, ()) {
                if evicted != hash {
                    batch.removed(evicted);
                }
            }
            let extra_keys = prompt.extra_keys(index);
            let block = StoredBlock {
                hash,
                parent: index.checked_sub(1).map(|i| hashes[i]),
                tokens: &prompt.tokens[index * BLOCK_TOKENS..][..BLOCK_TOKENS],
                lora: prompt.lora,
                extra_keys: extra_keys.as_deref(),
            };
            batch.stored(block, BLOCK_TOKENS as u32);
        }
        // The prompt's blocks, tail first, become the most recent: its head is evicted last,
        // as vLLM frees a finished request's blocks in reverse order (a prefix's first block
        // gone makes the rest useless).
        for hash in hashes.iter().rev() {
            cache.promote(hash);
        }
        self.publish(batch);
        cached
    }

    fn publish(&self, batch: Batch) {
        if let Some(sink) = &self.events {
            sink.publish(batch.into_events());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(tokens: &[u32]) -> PromptBlocks<'_> {
        PromptBlocks {
            tokens,
            lora: None,
            cache_salt: None,
        }
    }

    fn ids(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn the_cached_prefix_is_not_computed_again() {
        let cache = PrefixCache::new(NonZeroUsize::new(100).unwrap(), None);
        let first = ids(0..40);
        assert_eq!(cache.compute(prompt(&first)), 0);
        // The same 40 tokens and 20 more: two whole blocks (32 tokens) were cached.
        let next = ids(0..60);
        assert_eq!(cache.compute(prompt(&next)), 32);
        assert_eq!(cache.queries.load(Ordering::Relaxed), 100);
        assert_eq!(cache.hits.load(Ordering::Relaxed), 32);
        // Another prefix shares nothing, even with the same tokens later.
        let shifted = [&[999][..], &next].concat();
        assert_eq!(cache.compute(prompt(&shifted)), 0);
        // Nor does the same prompt under an adapter, another adapter, the adapter's name at
        // another path, or a salt that is the adapter's name.
        let adapter = |name: &str, path: &str| Adapter {
            name: name.into(),
            path: path.into(),
            id: 1,
        };
        let adapters = [adapter("s", "/a"), adapter("t", "/a"), adapter("s", "/b")];
        for lora in &adapters {
            let lora = PromptBlocks {
                lora: Some(lora),
                ..prompt(&next)
            };
            assert_eq!(cache.compute(lora), 0);
        }
        let salted = PromptBlocks {
            cache_salt: Some("s"),
            ..prompt(&next)
        };
        assert_eq!(cache.compute(salted), 0);
        let again = PromptBlocks {
            lora: Some(&adapters[0]),
            ..prompt(&next)
        };
        assert_eq!(cache.compute(again), 48);
    }

    #[test]
    fn stored_kv_is_found_and_old_blocks_leave() {
        let cache = PrefixCache::new(NonZeroUsize::new(2).unwrap(), None);
        cache.store(prompt(&ids(0..32)));
        assert_eq!(cache.queries.load(Ordering::Relaxed), 0);
        assert_eq!(cache.compute(prompt(&ids(0..32))), 32);
        cache.store(prompt(&ids(100..132)));
        assert_eq!(cache.compute(prompt(&ids(0..32))), 0);
        cache.clear();
        assert_eq!(cache.compute(prompt(&ids(0..32))), 0);
    }

    #[test]
    fn a_prompt_s_own_blocks_are_evicted_last() {
        let cache = PrefixCache::new(NonZeroUsize::new(3).unwrap(), None);
        cache.store(prompt(&ids(0..32)));
        cache.store(prompt(&ids(100..116)));
        // Two cached blocks and one new: the other prompt's block makes room.
        assert_eq!(cache.compute(prompt(&ids(0..48))), 32);
        assert_eq!(cache.compute(prompt(&ids(0..48))), 48);
    }
}
