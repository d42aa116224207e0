//! Bench support, not API: the synthetic KV-event traffic and the prompt that `pd-bench
//! kv-index` times the index on. A block stored or removed counts as one block event.

use pd_protocol::kv_events::{BlockHash, BlockRemoved, BlockStored, KvEvent};

use super::{EngineSlot, KvIndex, KvIndexConfig};

/// Tokens per block.
pub const BLOCK: usize = 16;
/// Blocks of the prefix every engine shares.
const SHARED: i128 = 32;
/// Blocks per event.
const EVENT: i128 = 16;
/// Events an engine holds before their blocks are removed.
const LAG: i128 = 100;

/// A fixed pseudo-random token stream (xorshift).
struct Tokens(u64);

impl Tokens {
    fn next(&mut self) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % 150_000) as u32
    }

    fn take(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// Block number `n`'s engine hash: scattered, as engines' hashes are.
fn hash(n: i128) -> BlockHash {
    BlockHash::Int(i128::from((n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
}

fn stored(blocks: std::ops::Range<i128>, parent: Option<i128>, tokens: Vec<u32>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: blocks.map(hash).collect(),
        parent_block_hash: parent.map(hash),
        token_ids: tokens,
        block_size: BLOCK as u32,
        medium: Some("GPU".into()),
        group_idx: Some(0),
        ..BlockStored::default()
    })
}

/// `engines` engines' events: a 32-block prefix all share, then `rounds` rounds of one
/// 16-block event per engine, each continuing the engine's chain, with the blocks of its event
/// 100 rounds back removed. With `reuse`, each event follows the shared prefix announced again
/// (vLLM re-announces the reused prefix blocks of every request).
pub fn traffic(engines: u32, rounds: i128, reuse: bool) -> Vec<(EngineSlot, KvEvent)> {
    let mut tokens = Tokens(0x9e37_79b9_7f4a_7c15);
    let shared = tokens.take(SHARED as usize * BLOCK);
    let mut events = Vec::new();
    for e in (0..engines).map(EngineSlot) {
        events.push((e, stored(0..SHARED, None, shared.clone())));
    }
    for round in 0..rounds {
        for e in (0..engines).map(EngineSlot) {
            if reuse {
                events.push((e, stored(0..SHARED, None, shared.clone())));
            }
            let first = SHARED + round * EVENT;
            let text = tokens.take(EVENT as usize * BLOCK);
            events.push((e, stored(first..first + EVENT, Some(first - 1), text)));
            if round >= LAG {
                let old = first - LAG * EVENT;
                let removed = BlockRemoved {
                    block_hashes: (old..old + EVENT).map(hash).collect(),
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                    ..BlockRemoved::default()
                };
                events.push((e, KvEvent::BlockRemoved(removed)));
            }
        }
    }
    events
}

/// The block events (blocks stored or removed) in `events`.
pub fn block_events(events: &[(EngineSlot, KvEvent)]) -> usize {
    (events.iter())
        .map(|(_, event)| match event {
            KvEvent::BlockStored(s) => s.block_hashes.len(),
            KvEvent::BlockRemoved(r) => r.block_hashes.len(),
            _ => 0,
        })
        .sum()
}

/// A `tokens`-token prompt, and an index (default bounds) of `engines` engines, each holding
/// a part of the prompt's leading blocks (engine `e`: `7e mod (blocks + 1)`, so some all of
/// it) and `own` blocks of its own.
pub fn match_fixture(engines: u32, tokens: usize, own: usize) -> (KvIndex, Vec<u32>) {
    let mut stream = Tokens(0x2545_f491_4f6c_dd1d);
    let prompt = stream.take(tokens);
    let blocks = (prompt.len() / BLOCK) as i128;
    let mut index = KvIndex::new(KvIndexConfig::default());
    for e in 0..engines {
        let held = (i128::from(e) * 7) % (blocks + 1);
        let held_tokens = prompt[..held as usize * BLOCK].to_vec();
        let base = i128::from(e) << 32;
        index.apply(EngineSlot(e), &stored(base..base + held, None, held_tokens));
        let mine = base + blocks + 1;
        let text = stream.take(own * BLOCK);
        index.apply(EngineSlot(e), &stored(mine..mine + own as i128, None, text));
    }
    (index, prompt)
}

/// A prompt of `tokens` tokens no engine of [`match_fixture`] holds.
pub fn unknown_prompt(tokens: usize) -> Vec<u32> {
    Tokens(0x1234_5678_9abc_def1).take(tokens)
}
