//! Python's `random.Random(seed).randrange(n)`, number for number: the oracle's random rule
//! draws from it, and the order-only replay must place each request where the oracle does.

use rand_mt::Mt;

/// The Mersenne Twister as CPython seeds and reads it.
pub struct PythonRandom(Mt);

impl PythonRandom {
    /// `random.Random(seed)`: CPython seeds with the seed's 32-bit words (one word for a seed
    /// below 2^32, zero included).
    pub fn new(seed: u32) -> Self {
        PythonRandom(Mt::new_with_key([seed]))
    }

    /// `randrange(n)` for `n` >= 1: the top `n.bit_length()` bits of one 32-bit draw, drawn
    /// again until below `n` (so even `randrange(1)` draws).
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "randrange of an empty range");
        let bits = usize::BITS - n.leading_zeros();
        assert!(bits <= 32, "randrange of more than 2^32 engines");
        loop {
            let drawn = (self.0.next_u32() >> (32 - bits)) as usize;
            if drawn < n {
                return drawn;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_draws_are_cpythons() {
        // python3 -c "import random; r = random.Random(0); print([r.randrange(10) for _ in range(12)])"
        let mut random = PythonRandom::new(0);
        let drawn: Vec<usize> = (0..12).map(|_| random.below(10)).collect();
        assert_eq!(drawn, [6, 6, 0, 4, 8, 7, 6, 4, 7, 5, 9, 3]);
        // randrange(1) draws too: the next three are what follows one draw.
        let mut random = PythonRandom::new(0);
        assert_eq!(random.below(1), 0);
        let next: Vec<usize> = (0..3).map(|_| random.below(10)).collect();
        assert_eq!(next, [6, 0, 4]);
    }
}
