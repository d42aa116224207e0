//! [`Table`]: an open-addressing hash table from `u64` to a small value, key and value side by
//! side in one slot, so that a lookup in a table far larger than the caches costs one cache
//! miss (a general-purpose table keeps its control bytes apart from its slots: two). Linear
//! probing, at most [`FULL`] full, removal by backward shift (no tombstones). A slot is free when
//! its value is [`Value::EMPTY`], which the caller never stores. Doubled when full, but never
//! beyond what the most keys the caller will hold need (a key's first slot is its spread hash
//! scaled to the table, so any size works): a table at the index's cap is full, not half full.

/// Fibonacci hashing's multiplier (2^64 / the golden ratio): spreads sequential keys too.
const SPREAD: u64 = 0x9e37_79b9_7f4a_7c15;

/// The most a table is filled, keys per slot: fuller, linear probing's runs grow long (looking
/// up an absent key reads about 6 adjacent slots in a table 7/10 full, 13 at 4/5).
const FULL: (usize, usize) = (7, 10);

/// The fewest slots of a non-empty table.
const MIN_SLOTS: usize = 16;

/// Starts loading `value`'s cache line, without waiting for it: a hint, which reads nothing
/// (where the CPU has no such hint, a load whose value is unused).
#[inline(always)]
pub(super) fn prefetch<T: Copy>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch only hints the cache: it reads and writes nothing the program sees and
    // cannot fault; `sse`, which it needs, is part of every x86_64 target.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::hint::black_box(*value);
}

/// A value a [`Table`] can hold: it has a value meaning "free slot".
pub(super) trait Value: Copy {
    /// The free slot's value.
    const EMPTY: Self;
    /// Whether this is the free slot's value.
    fn is_empty(&self) -> bool;
}

impl Value for u32 {
    const EMPTY: u32 = u32::MAX;

    fn is_empty(&self) -> bool {
        *self == u32::MAX
    }
}

/// The table.
#[derive(Debug)]
pub(super) struct Table<V> {
    slots: Vec<(u64, V)>,
    len: usize,
    /// The slots that `max_len` keys need.
    limit: usize,
}

impl<V: Value> Table<V> {
    /// An empty table that will hold at most `max_len` keys (more still work, in more memory).
    pub(super) fn new(max_len: usize) -> Self {
        Table {
            slots: Vec::new(),
            len: 0,
            limit: max_len.saturating_mul(FULL.1) / FULL.0 + 2,
        }
    }

    /// How many keys it holds.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Its memory, in bytes.
    pub(super) fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<(u64, V)>()
    }

    fn home(&self, key: u64) -> usize {
        ((u128::from(key.wrapping_mul(SPREAD)) * self.slots.len() as u128) >> 64) as usize
    }

    fn after(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    /// The slot holding `key`.
    fn find(&self, key: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mut i = self.home(key);
        loop {
            let (k, v) = &self.slots[i];
            if v.is_empty() {
                return None;
            }
            if *k == key {
                return Some(i);
            }
            i = self.after(i);
        }
    }

    /// Starts loading `key`'s first slot into the cache, ahead of a lookup: a few of these in a
    /// row overlap their cache misses, where lookups one after the other would wait for each.
    pub(super) fn prefetch(&self, key: u64) {
        if !self.slots.is_empty() {
            prefetch(&self.slots[self.home(key)]);
        }
    }

    /// The value of `key`.
    pub(super) fn get(&self, key: u64) -> Option<V> {
        self.find(key).map(|i| self.slots[i].1)
    }

    /// The value of `key`, inserted with `make` if absent.
    pub(super) fn get_or_insert_with(&mut self, key: u64, make: impl FnOnce() -> V) -> &mut V {
        if (self.len + 1) * FULL.1 > self.slots.len() * FULL.0 {
            self.grow();
        }
        let mut i = self.home(key);
        loop {
            let (k, v) = self.slots[i];
            if v.is_empty() {
                self.slots[i] = (key, make());
                self.len += 1;
                break;
            }
            if k == key {
                break;
            }
            i = self.after(i);
        }
        &mut self.slots[i].1
    }

    /// Sets `key`'s value (not [`Value::EMPTY`]).
    pub(super) fn insert(&mut self, key: u64, value: V) {
        *self.get_or_insert_with(key, || value) = value;
    }

    /// Removes `key`; its value.
    pub(super) fn remove(&mut self, key: u64) -> Option<V> {
        let i = self.find(key)?;
        let value = self.slots[i].1;
        self.vacate(i);
        Some(value)
    }

    /// Lets `change` modify `key`'s value (if any); a value left [`Value::EMPTY`] is removed.
    pub(super) fn modify(&mut self, key: u64, change: impl FnOnce(&mut V)) {
        if let Some(i) = self.find(key) {
            change(&mut self.slots[i].1);
            if self.slots[i].1.is_empty() {
                self.vacate(i);
            }
        }
    }

    /// Every value, in no order.
    pub(super) fn values(&self) -> impl Iterator<Item = V> + '_ {
        self.slots.iter().map(|s| s.1).filter(|v| !v.is_empty())
    }

    /// Frees slot `i`, moving back the keys after it that probed past it.
    fn vacate(&mut self, mut i: usize) {
        let mut j = i;
        loop {
            j = self.after(j);
            let (k, v) = self.slots[j];
            if v.is_empty() {
                break;
            }
            // `j`'s key may fill the hole at `i` unless its home lies in (i, j], cyclically.
            let home = self.home(k);
            let stays = if i <= j {
                i < home && home <= j
            } else {
                i < home || home <= j
            };
            if !stays {
                self.slots[i] = self.slots[j];
                i = j;
            }
        }
        self.slots[i].1 = V::EMPTY;
        self.len -= 1;
    }

    fn grow(&mut self) {
        let old = self.slots.len();
        let mut slots = (old * 2).max(MIN_SLOTS);
        if old < self.limit && self.limit < slots {
            slots = self.limit;
        }
        let old = std::mem::replace(&mut self.slots, vec![(0, V::EMPTY); slots]);
        for (k, v) in old {
            if !v.is_empty() {
                let mut i = self.home(k);
                while !self.slots[i].1.is_empty() {
                    i = self.after(i);
                }
                self.slots[i] = (k, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn behaves_like_a_hash_map() {
        let mut table = Table::<u32>::new(1000);
        let mut model = HashMap::new();
        let mut x = 0x1234_5678_u64;
        for step in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct keys, some sequential, so that runs collide and shift.
            let key = if step % 3 == 0 { x % 64 } else { x % 5000 };
            match x % 4 {
                0 => assert_eq!(table.remove(key), model.remove(&key)),
                1 => table.modify(key, |v| *v = if step % 2 == 0 { u32::EMPTY } else { step }),
                _ => {
                    table.insert(key, step);
                    model.insert(key, step);
                }
            }
            if x % 4 == 1 && model.contains_key(&key) {
                if step % 2 == 0 {
                    model.remove(&key);
                } else {
                    model.insert(key, step);
                }
            }
            assert_eq!(table.get(key), model.get(&key).copied());
        }
        assert_eq!(table.len(), model.len());
        for (k, v) in &model {
            assert_eq!(table.get(*k), Some(*v));
        }
        let mut values: Vec<u32> = table.values().collect();
        let mut expected: Vec<u32> = model.values().copied().collect();
        values.sort_unstable();
        expected.sort_unstable();
        assert_eq!(values, expected);
    }
}
