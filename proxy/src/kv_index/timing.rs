//! Rough timings, ignored by default; meaningful in release mode only:
//! `cargo test -p pd-proxy --release --lib kv_index::timing -- --ignored --nocapture`.

use std::time::{Duration, Instant};

use pd_protocol::kv_events::{BlockHash, BlockRemoved, BlockStored, KvEvent};

use super::*;

const BLOCK: usize = 16;
const ENGINES: u32 = 1000;
/// Events held before their blocks are removed.
const LAG: i128 = 100;

/// A fixed pseudo-random token stream.
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

fn event(blocks: std::ops::Range<i128>, parent: Option<i128>, tokens: Vec<u32>) -> KvEvent {
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

/// Every engine: a 32-block prefix all share, then 16-block events, each continuing the one
/// before; after each, the blocks of the one [`LAG`] back removed. With `reuse`, each event
/// comes after the shared prefix announced again (vLLM re-announces reused prefix blocks).
fn traffic(rounds: i128, reuse: bool) -> Vec<(EngineSlot, KvEvent)> {
    let mut tokens = Tokens(0x9e37_79b9_7f4a_7c15);
    let shared = tokens.take(32 * BLOCK);
    let mut events = Vec::new();
    for e in 0..ENGINES {
        events.push((EngineSlot(e), event(0..32, None, shared.clone())));
    }
    for round in 0..rounds {
        for e in (0..ENGINES).map(EngineSlot) {
            if reuse {
                events.push((e, event(0..32, None, shared.clone())));
            }
            let first = 32 + round * 16;
            let text = tokens.take(16 * BLOCK);
            events.push((e, event(first..first + 16, Some(first - 1), text)));
            if round >= LAG {
                let old = first - LAG * 16;
                let removed = BlockRemoved {
                    block_hashes: (old..old + 16).map(hash).collect(),
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                };
                events.push((e, KvEvent::BlockRemoved(removed)));
            }
        }
    }
    events
}

#[test]
#[ignore]
fn ingestion_rate() {
    for (reuse, max_entries) in [(false, 4_000_000), (false, 500_000), (true, 4_000_000)] {
        let events = traffic(120, reuse);
        let mut best = Duration::MAX;
        let mut last = None;
        for _ in 0..3 {
            let mut idx = KvIndex::new(KvIndexConfig {
                max_entries,
                ..KvIndexConfig::default()
            });
            let start = Instant::now();
            let mut total = Applied::default();
            for (engine, event) in &events {
                let a = idx.apply(*engine, event);
                total.stored += a.stored;
                total.removed += a.removed;
                total.ignored += a.ignored;
                total.evicted += a.evicted;
            }
            best = best.min(start.elapsed());
            last = Some((total, idx.stats()));
        }
        let Some((total, stats)) = last else { return };
        let blocks = total.stored + total.removed + total.ignored;
        println!(
            "reuse {reuse}, cap {max_entries}: {blocks} block events in {best:?}: {:.1} M/s; \
             {total:?}; {} pairs, {} keys, {} bytes ({} per pair)",
            blocks as f64 / best.as_secs_f64() / 1e6,
            stats.blocks,
            stats.keys,
            stats.bytes,
            stats.bytes / stats.blocks.max(1),
        );
    }
}

#[test]
#[ignore]
fn match_time_2048_tokens_1000_engines() {
    let mut tokens = Tokens(0x2545_f491_4f6c_dd1d);
    let prompt = tokens.take(2048);
    let blocks = (prompt.len() / BLOCK) as i128;
    let mut idx = KvIndex::new(KvIndexConfig::default());
    // Every engine holds a part of the prompt's leading blocks (all of it for some), and
    // 2,000 blocks of its own.
    for e in 0..ENGINES {
        let held = (i128::from(e) * 7) % (blocks + 1);
        let held_tokens = prompt[..held as usize * BLOCK].to_vec();
        let base = i128::from(e) << 32;
        idx.apply(EngineSlot(e), &event(base..base + held, None, held_tokens));
        let own = base + 1_000;
        idx.apply(
            EngineSlot(e),
            &event(own..own + 2_000, None, tokens.take(2_000 * BLOCK)),
        );
    }
    let key = RequestKey::default();
    // Caches emptied before each match: 128 MB read.
    let flush: Vec<u64> = (0..16u64 << 20).collect();
    let mut cold: Vec<Duration> = (0..100)
        .map(|_| {
            std::hint::black_box(flush.iter().sum::<u64>());
            let start = Instant::now();
            std::hint::black_box(idx.match_prefix(&key, &prompt, BLOCK));
            start.elapsed()
        })
        .collect();
    cold.sort();
    for (name, prompt) in [("shared", prompt.clone()), ("unknown", tokens.take(2048))] {
        let iterations = 20_000;
        let start = Instant::now();
        let mut engines = 0;
        for _ in 0..iterations {
            engines += std::hint::black_box(idx.match_prefix(&key, &prompt, BLOCK)).len();
        }
        println!(
            "{name} prompt: {:?} per match, {} engines matched, index of {} pairs",
            start.elapsed() / iterations,
            engines / iterations as usize,
            idx.stats().blocks,
        );
    }
    println!("shared prompt, caches emptied first: median {:?}", cold[50]);
}
