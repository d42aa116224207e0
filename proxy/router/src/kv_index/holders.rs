//! [`Holders`]: the engines holding one block key. Up to [`INLINE`] engine slots are kept in
//! place (16 bytes, no allocation: most blocks are held by one or two engines); beyond, a
//! bitset over the engine slots from a pool ([`Bitsets`]), so a block every engine holds (a
//! shared system prompt) is matched a word (64 engines) at a time.

use super::table::{prefetch, Value};

/// Engine slots kept in place before a key's holders move to a bitset.
pub(super) const INLINE: usize = 3;

/// The engines holding one key: `len` slots inline while `len <= INLINE`, else `len` engines in
/// the pool's bitset number `slots[0]`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Holders {
    slots: [u32; INLINE],
    len: u32,
}

/// The holders of a key as matching reads them.
pub(super) enum View<'a> {
    /// A few engine slots.
    Few(&'a [u32]),
    /// A bitset: engine `s` is bit `s % 64` of word `s / 64`.
    Bits(&'a [u64]),
}

/// The bitsets of keys with more than [`INLINE`] holders, side by side in one vector of
/// `stride` words each (as many as the largest engine slot set so far needs; all are widened
/// when a larger one comes), so that a key's slot leads straight to its bits. A freed bitset is
/// kept (zeroed) for the next key that needs one.
#[derive(Debug)]
pub(super) struct Bitsets {
    words: Vec<u64>,
    stride: usize,
    free: Vec<u32>,
}

impl Default for Bitsets {
    fn default() -> Self {
        Bitsets {
            words: Vec::new(),
            stride: 1,
            free: Vec::new(),
        }
    }
}

impl Bitsets {
    fn take(&mut self) -> u32 {
        self.free.pop().unwrap_or_else(|| {
            self.words.resize(self.words.len() + self.stride, 0);
            (self.words.len() / self.stride - 1) as u32
        })
    }

    fn release(&mut self, id: u32) {
        self.words_mut(id).fill(0);
        self.free.push(id);
    }

    fn words(&self, id: u32) -> &[u64] {
        &self.words[id as usize * self.stride..][..self.stride]
    }

    fn words_mut(&mut self, id: u32) -> &mut [u64] {
        &mut self.words[id as usize * self.stride..][..self.stride]
    }

    fn set(&mut self, id: u32, engine: u32) {
        let w = (engine / 64) as usize;
        if w >= self.stride {
            self.widen(w + 1);
        }
        self.words_mut(id)[w] |= 1 << (engine % 64);
    }

    /// Gives every bitset `stride` words.
    fn widen(&mut self, stride: usize) {
        let mut words = vec![0; self.words.len() / self.stride * stride];
        for (new, old) in words
            .chunks_exact_mut(stride)
            .zip(self.words.chunks_exact(self.stride))
        {
            new[..old.len()].copy_from_slice(old);
        }
        self.words = words;
        self.stride = stride;
    }

    /// The pool's memory, in bytes.
    pub(super) fn bytes(&self) -> usize {
        self.words.capacity() * 8 + self.free.capacity() * 4
    }
}

fn has(words: &[u64], engine: u32) -> bool {
    words
        .get((engine / 64) as usize)
        .is_some_and(|w| w & (1 << (engine % 64)) != 0)
}

impl Holders {
    /// Only `engine`.
    pub(super) fn one(engine: u32) -> Self {
        Holders {
            slots: [engine, 0, 0],
            len: 1,
        }
    }

    fn is_inline(&self) -> bool {
        self.len as usize <= INLINE
    }

    /// The engines, for matching.
    pub(super) fn view<'a>(&'a self, pool: &'a Bitsets) -> View<'a> {
        if self.is_inline() {
            View::Few(&self.slots[..self.len as usize])
        } else {
            View::Bits(pool.words(self.slots[0]))
        }
    }

    /// Starts loading the key's bitset, if any, into the cache ahead of matching.
    pub(super) fn prefetch(&self, pool: &Bitsets) {
        if !self.is_inline() {
            pool.words(self.slots[0])
                .iter()
                .step_by(8)
                .for_each(prefetch);
        }
    }

    /// Whether `engine` holds the key.
    pub(super) fn contains(&self, engine: u32, pool: &Bitsets) -> bool {
        match self.view(pool) {
            View::Few(slots) => slots.contains(&engine),
            View::Bits(words) => has(words, engine),
        }
    }

    /// Adds `engine` (nothing if it is there already).
    pub(super) fn insert(&mut self, engine: u32, pool: &mut Bitsets) {
        if self.contains(engine, pool) {
            return;
        }
        if (self.len as usize) < INLINE {
            self.slots[self.len as usize] = engine;
        } else if self.is_inline() {
            let id = pool.take();
            for s in self.slots {
                pool.set(id, s);
            }
            pool.set(id, engine);
            self.slots[0] = id;
        } else {
            pool.set(self.slots[0], engine);
        }
        self.len += 1;
    }

    /// Removes `engine` (nothing if it is not there); none left is [`Value::EMPTY`].
    pub(super) fn remove(&mut self, engine: u32, pool: &mut Bitsets) {
        if self.is_inline() {
            let n = self.len as usize;
            if let Some(i) = self.slots[..n].iter().position(|&s| s == engine) {
                self.slots[i] = self.slots[n - 1];
                self.len -= 1;
            }
            return;
        }
        let id = self.slots[0];
        let words = pool.words_mut(id);
        let bit = 1 << (engine % 64);
        match words.get_mut((engine / 64) as usize) {
            Some(word) if *word & bit != 0 => *word &= !bit,
            _ => return,
        }
        self.len -= 1;
        if self.is_inline() {
            let mut n = 0;
            for (w, &word) in words.iter().enumerate() {
                let mut bits = word;
                while bits != 0 && n < INLINE {
                    self.slots[n] = w as u32 * 64 + bits.trailing_zeros();
                    bits &= bits - 1;
                    n += 1;
                }
            }
            pool.release(id);
        }
    }
}

impl Value for Holders {
    const EMPTY: Holders = Holders {
        slots: [0; INLINE],
        len: 0,
    };

    fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engines(h: &Holders, pool: &Bitsets) -> Vec<u32> {
        let mut v = match h.view(pool) {
            View::Few(slots) => slots.to_vec(),
            View::Bits(words) => (0..words.len() as u32 * 64)
                .filter(|&s| has(words, s))
                .collect(),
        };
        v.sort_unstable();
        v
    }

    #[test]
    fn moves_to_a_bitset_and_back() {
        let mut pool = Bitsets::default();
        let mut h = Holders::one(7);
        for e in [200, 7, 3] {
            h.insert(e, &mut pool);
        }
        assert!(matches!(h.view(&pool), View::Few(_)));
        assert_eq!(engines(&h, &pool), [3, 7, 200]);
        h.insert(64, &mut pool);
        h.insert(64, &mut pool);
        assert!(matches!(h.view(&pool), View::Bits(_)));
        assert_eq!((h.len, engines(&h, &pool)), (4, vec![3, 7, 64, 200]));
        for e in [1000, 5, 7] {
            h.remove(e, &mut pool);
        }
        assert!(matches!(h.view(&pool), View::Few(_)));
        assert_eq!(engines(&h, &pool), [3, 64, 200]);
        assert_eq!(pool.free, [0]);
        assert!(pool.words(0).iter().all(|&w| w == 0));

        let mut other = Holders::one(1);
        for e in [2, 4, 5] {
            other.insert(e, &mut pool);
        }
        assert_eq!(pool.free, [] as [u32; 0]);
        assert_eq!(engines(&other, &pool), [1, 2, 4, 5]);

        for e in [3, 3, 64, 200] {
            h.remove(e, &mut pool);
        }
        assert!(h.is_empty());
    }
}
