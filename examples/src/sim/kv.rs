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

/// Where generated tokens' ids begin (above any prompt's: a byte-level or a model's vocabulary).
pub const GENERATED_IDS: u32 = 1 << 24;

/// An answer's tokens, each following from the whole context before it (the prompt's ids and
/// the tokens generated so far), as a model's greedy decoding does: an answer continued from
/// its prompt plus its first tokens (as ids) goes on exactly as it would have.
#[derive(Clone)]
pub struct Generator {
    context: DefaultHasher,
}

impl Generator {
    /// The generator of an answer to a prompt of these token ids.
    pub fn new(prompt: &[u32]) -> Self {
        let mut context = DefaultHasher::new();
        for id in prompt {
            context.write_u32(*id);
        }
        Generator { context }
    }

    /// The next token: its id and its text (with its leading space).
    pub fn next_token(&mut self) -> (u32, String) {
        let word = (self.context.clone().finish() % VOCABULARY.len() as u64) as u32;
        let id = GENERATED_IDS + word;
        self.context.write_u32(id);
        (id, format!(" {}", VOCABULARY[word as usize]))
    }
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
    }

    #[test]
    fn an_answer_continued_from_its_first_tokens_goes_on_as_it_would_have() {
        let prompt = [104, 105, 32, 116];
        let whole: Vec<(u32, String)> = {
            let mut generator = Generator::new(&prompt);
            (0..12).map(|_| generator.next_token()).collect()
        };
        let mut context = prompt.to_vec();
        context.extend(whole[..5].iter().map(|(id, _)| *id));
        let mut continued = Generator::new(&context);
        let rest: Vec<(u32, String)> = (0..7).map(|_| continued.next_token()).collect();
        assert_eq!(rest, whole[5..]);
        // Another prompt, another answer.
        let mut other = Generator::new(&[1, 2, 3]);
        let other: Vec<(u32, String)> = (0..12).map(|_| other.next_token()).collect();
        assert_ne!(other, whole);
    }
}
