//! [`Entries`]: every (engine, block) pair the index holds, in one slab, linked from the least
//! to the most recently stored or confirmed (the eviction order). 32 bytes a pair; a removed
//! pair's slot is reused, so nothing is allocated per block once the slab has grown, and it
//! grows no larger than the index's cap.

use super::table::prefetch;

/// No entry (the end of a list).
const NIL: u32 = u32::MAX;

/// One (engine, block) pair.
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry {
    /// The proxy's key of the block.
    pub key: u64,
    /// The engine's hash of the block, folded to 64 bits.
    pub hash: u64,
    /// The engine's slot.
    pub engine: u32,
    prev: u32,
    next: u32,
}

/// The slab, its free slots, and the recency list through it.
#[derive(Debug)]
pub(super) struct Entries {
    slots: Vec<Entry>,
    /// The most entries there will be (the slab grows up to this, not beyond).
    limit: usize,
    /// The first free slot; free slots are chained through `next`.
    free: u32,
    /// Least recently stored or confirmed.
    oldest: u32,
    /// Most recently stored or confirmed.
    newest: u32,
    len: usize,
}

impl Entries {
    /// No entries; there will be at most `limit`.
    pub(super) fn new(limit: usize) -> Self {
        Entries {
            slots: Vec::new(),
            limit,
            free: NIL,
            oldest: NIL,
            newest: NIL,
            len: 0,
        }
    }

    /// How many entries there are.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The entry `id` (an id this slab returned and has not removed since).
    pub(super) fn get(&self, id: u32) -> &Entry {
        &self.slots[id as usize]
    }

    /// Starts loading entry `id` into the cache.
    pub(super) fn prefetch(&self, id: u32) {
        if let Some(entry) = self.slots.get(id as usize) {
            prefetch(entry);
        }
    }

    /// Starts loading the entries before and after `id` in the recency list (removing or
    /// touching `id` rewrites them).
    pub(super) fn prefetch_neighbours(&self, id: u32) {
        let Entry { prev, next, .. } = self.slots[id as usize];
        [prev, next].into_iter().for_each(|id| self.prefetch(id));
    }

    /// The least recently stored or confirmed entry.
    pub(super) fn oldest(&self) -> Option<u32> {
        (self.oldest != NIL).then_some(self.oldest)
    }

    /// The entries from the least recently stored or confirmed on.
    pub(super) fn oldest_first(&self) -> impl Iterator<Item = &Entry> + '_ {
        let mut id = self.oldest;
        std::iter::from_fn(move || {
            let entry = self.slots.get(id as usize)?;
            id = entry.next;
            Some(entry)
        })
    }

    /// Adds an entry as the most recent; its id. The caller keeps `len` under `u32::MAX`.
    pub(super) fn insert(&mut self, key: u64, hash: u64, engine: u32) -> u32 {
        let entry = Entry {
            key,
            hash,
            engine,
            prev: NIL,
            next: NIL,
        };
        let id = if self.free == NIL {
            if self.slots.len() == self.slots.capacity() {
                let grown = (self.slots.capacity() * 2).clamp(64, self.limit.max(64));
                self.slots.reserve_exact(grown - self.slots.len());
            }
            self.slots.push(entry);
            (self.slots.len() - 1) as u32
        } else {
            let id = self.free;
            self.free = self.slots[id as usize].next;
            self.slots[id as usize] = entry;
            id
        };
        self.link_newest(id);
        self.len += 1;
        id
    }

    /// Makes `id` the most recent, with `key` as its key.
    pub(super) fn touch(&mut self, id: u32, key: u64) {
        self.slots[id as usize].key = key;
        if self.newest != id {
            self.unlink(id);
            self.link_newest(id);
        }
    }

    /// Removes `id`; what it was.
    pub(super) fn remove(&mut self, id: u32) -> Entry {
        self.unlink(id);
        let entry = self.slots[id as usize];
        self.slots[id as usize].next = self.free;
        self.free = id;
        self.len -= 1;
        entry
    }

    /// The slab's memory, in bytes.
    pub(super) fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Entry>()
    }

    fn link_newest(&mut self, id: u32) {
        let slot = &mut self.slots[id as usize];
        slot.prev = self.newest;
        slot.next = NIL;
        match self.newest {
            NIL => self.oldest = id,
            newest => self.slots[newest as usize].next = id,
        }
        self.newest = id;
    }

    fn unlink(&mut self, id: u32) {
        let Entry { prev, next, .. } = self.slots[id as usize];
        match prev {
            NIL => self.oldest = next,
            prev => self.slots[prev as usize].next = next,
        }
        match next {
            NIL => self.newest = prev,
            next => self.slots[next as usize].prev = prev,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(entries: &Entries) -> Vec<u64> {
        entries.oldest_first().map(|e| e.key).collect()
    }

    #[test]
    fn recency_order_and_slot_reuse() {
        let mut e = Entries::new(100);
        let ids: Vec<u32> = (1..=4).map(|k| e.insert(k, k, 0)).collect();
        assert_eq!(order(&e), [1, 2, 3, 4]);
        e.touch(ids[0], 1);
        e.touch(ids[2], 30);
        assert_eq!(order(&e), [2, 4, 1, 30]);
        assert_eq!(e.remove(ids[1]).key, 2);
        assert_eq!(e.remove(ids[3]).key, 4);
        assert_eq!(e.oldest(), Some(ids[0]));
        assert_eq!(e.insert(5, 5, 1), ids[3]);
        assert_eq!(order(&e), [1, 30, 5]);
        assert_eq!(e.len(), 3);
        for id in [ids[0], ids[2], ids[3]] {
            e.remove(id);
        }
        assert_eq!((e.len(), e.oldest()), (0, None));
        assert_eq!(e.bytes(), 64 * 32);
    }
}
