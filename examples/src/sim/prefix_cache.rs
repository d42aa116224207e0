//! A model of an engine's prefix cache (vLLM's automatic prefix caching, SGLang's radix cache):
//! a prompt is cut into blocks of [`BLOCK_TOKENS`] tokens, each named by a hash chained over the
//! blocks before it, and the engine keeps the most recently used blocks up to its capacity. The
//! leading blocks of a prompt found there are not computed again, so its prefill time shrinks
//! with them; KV pulled from a prefill lands in the cache too, as in a real decode. Queried and
//! hit tokens are counted as vLLM counts them (`prefix_cache_queries`, `prefix_cache_hits`).

use std::hash::{BuildHasher, Hasher};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use lru::LruCache;

/// Tokens per cached block (vLLM's default block size).
pub const BLOCK_TOKENS: usize = 16;

/// The cached blocks and the hit counters.
pub struct PrefixCache {
    blocks: Mutex<LruCache<u64, ()>>,
    /// Prompt tokens looked up.
    pub queries: AtomicU64,
    /// Of those, tokens found cached.
    pub hits: AtomicU64,
}

/// The chain hashes of `text`'s whole blocks of tokens, in order.
fn blocks(text: &str) -> Vec<u64> {
    let state = foldhash::fast::FixedState::with_seed(0x9c);
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut chain = 0u64;
    words
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            let mut h = state.build_hasher();
            h.write_u64(chain);
            for word in block {
                h.write(word.as_bytes());
                h.write_u8(b' ');
            }
            chain = h.finish();
            chain
        })
        .collect()
}

impl PrefixCache {
    /// A cache of `capacity` blocks.
    pub fn new(capacity: NonZeroUsize) -> Self {
        PrefixCache {
            blocks: Mutex::new(LruCache::new(capacity)),
            queries: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        }
    }

    fn blocks(&self) -> std::sync::MutexGuard<'_, LruCache<u64, ()>> {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Computing `text` (of `tokens` tokens): how many of its tokens were cached (counted as a
    /// query and its hits); all its whole blocks are cached afterwards.
    pub fn compute(&self, text: &str, tokens: u32) -> u32 {
        let chain = blocks(text);
        let mut cache = self.blocks();
        let cached = chain
            .iter()
            .take_while(|&&b| cache.get(&b).is_some())
            .count();
        for &block in &chain[cached..] {
            cache.put(block, ());
        }
        drop(cache);
        let hit = ((cached * BLOCK_TOKENS) as u32).min(tokens);
        self.queries.fetch_add(u64::from(tokens), Ordering::Relaxed);
        self.hits.fetch_add(u64::from(hit), Ordering::Relaxed);
        hit
    }

    /// Caches `text`'s blocks without counting a query (KV that arrived from a prefill).
    pub fn store(&self, text: &str) {
        let mut cache = self.blocks();
        for block in blocks(text) {
            cache.put(block, ());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(n: usize, tag: &str) -> String {
        (0..n).map(|i| format!("{tag}{i} ")).collect()
    }

    #[test]
    fn the_cached_prefix_is_not_computed_again() {
        let cache = PrefixCache::new(NonZeroUsize::new(100).unwrap());
        let first = words(40, "a");
        assert_eq!(cache.compute(&first, 40), 0);
        // The same 40 tokens and 20 more: two whole blocks (32 tokens) were cached.
        let next = format!("{first}{}", words(20, "b"));
        assert_eq!(cache.compute(&next, 60), 32);
        assert_eq!(cache.queries.load(Ordering::Relaxed), 100);
        assert_eq!(cache.hits.load(Ordering::Relaxed), 32);
        // Another prefix shares nothing, even with the same words later.
        assert_eq!(cache.compute(&format!("x {next}"), 61), 0);
    }

    #[test]
    fn stored_kv_is_found_and_old_blocks_leave() {
        let cache = PrefixCache::new(NonZeroUsize::new(2).unwrap());
        cache.store(&words(32, "s"));
        assert_eq!(cache.queries.load(Ordering::Relaxed), 0);
        assert_eq!(cache.compute(&words(32, "s"), 32), 32);
        cache.store(&words(32, "t"));
        assert_eq!(cache.compute(&words(32, "s"), 32), 0);
    }
}
