//! [`PrefixIndex`]: which backend served which prompt prefixes, approximately and in bounded
//! memory.
//!
//! A prompt is cut into blocks of [`BLOCK_BYTES`] bytes and each block is named by a hash
//! chained over every block before it, so a block's hash stands for the whole prefix up to its
//! end: the chain hashes of a prompt are the nodes of its path in a prefix tree, without storing
//! the tree. The index maps a node to the backends that served it and when; the longest prefix
//! a backend holds is the number of leading nodes it is listed under. Entries beyond the
//! capacity leave least recently used first, as an engine's own prefix cache evicts.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::sync::Mutex;

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

/// Which backends served which prefixes.
#[derive(Debug)]
pub struct PrefixIndex {
    inner: Mutex<Entries>,
}

#[derive(Debug)]
struct Entries {
    /// Node -> (backend id, last use) of every backend that served it.
    nodes: HashMap<u64, Vec<(u64, u64)>>,
    /// (last use, node, backend) in order of use; stale when the node's entry is newer.
    order: VecDeque<(u64, u64, u64)>,
    /// Entries in `nodes`.
    len: usize,
    capacity: usize,
    clock: u64,
}

impl PrefixIndex {
    /// An index holding at most `capacity` (node, backend) entries.
    pub fn new(capacity: usize) -> Self {
        PrefixIndex {
            inner: Mutex::new(Entries {
                nodes: HashMap::new(),
                order: VecDeque::new(),
                len: 0,
                capacity: capacity.max(1),
                clock: 0,
            }),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// For each of `backends`, how many leading blocks of `blocks` it served.
    pub fn matches(&self, blocks: &[u64], backends: &[u64]) -> Vec<usize> {
        let entries = self.entries();
        let mut matched = vec![0; backends.len()];
        for (depth, node) in blocks.iter().enumerate() {
            let Some(holders) = entries.nodes.get(node) else {
                break;
            };
            let mut any = false;
            for (i, backend) in backends.iter().enumerate() {
                if matched[i] == depth && holders.iter().any(|(b, _)| b == backend) {
                    matched[i] = depth + 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        matched
    }

    /// Records that `backend` served `blocks` (it now caches them), evicting the least
    /// recently used entries beyond the capacity.
    pub fn insert(&self, blocks: &[u64], backend: u64) {
        let mut entries = self.entries();
        let Entries {
            nodes,
            order,
            len,
            clock,
            ..
        } = &mut *entries;
        for node in blocks {
            *clock += 1;
            let holders = nodes.entry(*node).or_default();
            match holders.iter_mut().find(|(b, _)| *b == backend) {
                Some(entry) => entry.1 = *clock,
                None => {
                    holders.push((backend, *clock));
                    *len += 1;
                }
            }
            order.push_back((*clock, *node, backend));
        }
        entries.evict();
    }

    /// How many (node, backend) entries are held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries().len
    }
}

impl Entries {
    fn evict(&mut self) {
        while self.len > self.capacity {
            let Some((used, node, backend)) = self.order.pop_front() else {
                break;
            };
            let Some(holders) = self.nodes.get_mut(&node) else {
                continue;
            };
            // Only the entry's latest use removes it; older ones are stale.
            if let Some(at) = holders.iter().position(|&(b, t)| b == backend && t == used) {
                holders.swap_remove(at);
                self.len -= 1;
                if holders.is_empty() {
                    self.nodes.remove(&node);
                }
            }
        }
        // Stale uses pile up while nothing is evicted: drop them once they outnumber the live.
        if self.order.len() > 2 * self.capacity.max(self.len) {
            let nodes = &self.nodes;
            self.order.retain(|&(used, node, backend)| {
                nodes
                    .get(&node)
                    .is_some_and(|h| h.iter().any(|&(b, t)| b == backend && t == used))
            });
        }
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
        assert!(index.entries().order.len() <= 8);
    }
}
