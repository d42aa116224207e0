//! [`PrefixIndex`]: which backend served which prompt prefixes, approximately and in bounded
//! memory.
//!
//! A prompt is cut into blocks of [`BLOCK_BYTES`] bytes and each block is named by a hash
//! chained over every block before it, so a block's hash stands for the whole prefix up to its
//! end: the chain hashes of a prompt are the nodes of its path in a prefix tree, without storing
//! the tree. The index holds (node, backend) pairs; the longest prefix a backend holds is the
//! number of leading nodes held with it. Pairs beyond the capacity leave least recently used
//! first, as an engine's own prefix cache evicts.

use std::hash::{BuildHasher, Hasher};
use std::num::NonZeroUsize;
use std::sync::Mutex;

use lru::LruCache;

use crate::sync::lock;

/// Bytes per block: a few dozen tokens, the granularity of engines' prefix caches.
pub const BLOCK_BYTES: usize = 64;

/// The chain hashes of `text`'s whole blocks, in order (a trailing partial block is not
/// cached by engines either).
pub fn prefix_blocks(text: &str) -> Vec<u64> {
    let hasher = foldhash::fast::FixedState::with_seed(0x5eed);
    let mut chain = 0u64;
    text.as_bytes()
        .chunks_exact(BLOCK_BYTES)
        .map(|block| {
            let mut h = hasher.build_hasher();
            h.write_u64(chain);
            h.write(block);
            chain = h.finish();
            chain
        })
        .collect()
}

/// Which backends served which prefixes: (node, backend) pairs, least recently used evicted.
#[derive(Debug)]
pub struct PrefixIndex {
    pairs: Mutex<LruCache<(u64, u64), ()>>,
}

impl PrefixIndex {
    /// An index holding at most `capacity` (node, backend) pairs.
    pub fn new(capacity: usize) -> Self {
        let capacity = NonZeroUsize::new(capacity).unwrap_or(NonZeroUsize::MIN);
        PrefixIndex {
            pairs: Mutex::new(LruCache::new(capacity)),
        }
    }

    fn pairs(&self) -> std::sync::MutexGuard<'_, LruCache<(u64, u64), ()>> {
        lock(&self.pairs)
    }

    /// For each of `backends`, how many leading blocks of `blocks` it served.
    pub fn matches(&self, blocks: &[u64], backends: &[u64]) -> Vec<usize> {
        let pairs = self.pairs();
        backends
            .iter()
            .map(|&backend| {
                blocks
                    .iter()
                    .take_while(|&&node| pairs.contains(&(node, backend)))
                    .count()
            })
            .collect()
    }

    /// Records that `backend` served `blocks` (it now caches them), evicting the least
    /// recently used pairs beyond the capacity.
    pub fn insert(&self, blocks: &[u64], backend: u64) {
        let mut pairs = self.pairs();
        for &node in blocks {
            pairs.put((node, backend), ());
        }
    }

    /// How many (node, backend) pairs are held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.pairs().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(blocks: &[char]) -> String {
        blocks
            .iter()
            .map(|c| c.to_string().repeat(BLOCK_BYTES))
            .collect()
    }

    #[test]
    fn blocks_name_whole_prefixes() {
        let a = prefix_blocks(&text(&['a', 'b', 'c']));
        let b = prefix_blocks(&text(&['a', 'b', 'd']));
        assert_eq!(a.len(), 3);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // The same block after a different prefix is another node.
        assert_ne!(prefix_blocks(&text(&['x', 'c']))[1], a[2]);
        assert!(prefix_blocks("short").is_empty());
    }

    #[test]
    fn matches_count_leading_blocks_per_backend() {
        let index = PrefixIndex::new(100);
        index.insert(&prefix_blocks(&text(&['s', 'a', 'b'])), 1);
        index.insert(&prefix_blocks(&text(&['s', 'x'])), 2);
        let asked = prefix_blocks(&text(&['s', 'a', 'z']));
        assert_eq!(index.matches(&asked, &[1, 2, 3]), [2, 1, 0]);
    }

    #[test]
    fn the_least_recently_used_entries_leave_first() {
        let index = PrefixIndex::new(4);
        let old = prefix_blocks(&text(&['o', 'l']));
        let new = prefix_blocks(&text(&['n', 'e']));
        index.insert(&old, 1);
        index.insert(&new, 1);
        assert_eq!(index.len(), 4);
        index.insert(&old, 1); // used again: now the newest
        index.insert(&prefix_blocks(&text(&['t'])), 2);
        assert_eq!(index.len(), 4);
        assert_eq!(index.matches(&old, &[1]), [2]);
        assert_eq!(index.matches(&new, &[1]), [0]);
        for i in 0..10_000u64 {
            index.insert(&[i], 3);
        }
        assert_eq!(index.len(), 4);
    }
}
