//! Deterministic stand-ins for a model's KV cache and its output, so D can verify every byte it
//! pulled and answers are reproducible.

use std::hash::{DefaultHasher, Hash, Hasher};

use bytes::Bytes;
use pd_transfer::pattern;

/// Where one share of a request's KV was computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Shard {
    /// P's dp rank.
    pub dp: u32,
    /// P's tp rank.
    pub tp: u32,
    /// P's pp rank.
    pub pp: u32,
}

fn seed(prompt: &[u32], shard: Shard) -> u64 {
    let mut hasher = DefaultHasher::new();
    prompt.hash(&mut hasher);
    shard.hash(&mut hasher);
    hasher.finish()
}

/// The KV bytes one P worker holds for `prompt` (its token ids): `len` bytes of the transfer
/// pattern seeded by the prompt and the worker's ranks.
pub fn kv_bytes(prompt: &[u32], shard: Shard, len: usize) -> Bytes {
    Bytes::from(pattern(seed(prompt, shard), len))
}

/// Bytes of KV one worker holds for a prompt of `tokens` tokens, split over `tp x pp` workers.
pub fn shard_len(tokens: u32, bytes_per_token: usize, tp_size: usize, pp_size: usize) -> usize {
    (tokens as usize * bytes_per_token).div_ceil((tp_size * pp_size).max(1))
}

const VOCABULARY: &[&str] = &[
    "the", "cache", "moves", "from", "prefill", "to", "decode", "over", "a", "fast", "path", "and",
    "tokens", "stream", "back", "quickly",
];

/// The `index`-th generated token for `prompt` (its token ids), with its leading space.
pub fn token(prompt: &[u32], index: u32) -> String {
    let mut hasher = DefaultHasher::new();
    prompt.hash(&mut hasher);
    index.hash(&mut hasher);
    format!(
        " {}",
        VOCABULARY[(hasher.finish() % VOCABULARY.len() as u64) as usize]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_is_deterministic_and_differs_per_shard() {
        let a = Shard {
            dp: 0,
            tp: 0,
            pp: 0,
        };
        let b = Shard {
            dp: 0,
            tp: 1,
            pp: 0,
        };
        let (p, q) = (&[1, 2][..], &[1, 3][..]);
        assert_eq!(kv_bytes(p, a, 100), kv_bytes(p, a, 100));
        assert_ne!(kv_bytes(p, a, 100), kv_bytes(p, b, 100));
        assert_ne!(kv_bytes(p, a, 100), kv_bytes(q, a, 100));
        assert_eq!(kv_bytes(p, a, 13).len(), 13);
        assert_eq!(shard_len(10, 100, 2, 1), 500);
        assert_eq!(token(p, 3), token(p, 3));
    }
}
