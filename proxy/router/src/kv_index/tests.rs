//! The index's behaviour: storing, removing, clearing, orphans, the cap, matching. Helpers
//! shared with `tests_vllm.rs`.

use pd_protocol::kv_events::{BlockHash, BlockRemoved, BlockStored, EventBatch, ExtraValue};

use super::*;

pub(super) const BS: u32 = 4;

pub(super) fn index() -> KvIndex {
    KvIndex::new(KvIndexConfig::default())
}

/// Blocks `hashes`, chained on `parent`, whose tokens are `first_token..` (BS per block).
pub(super) fn stored(hashes: &[i128], parent: Option<i128>, first_token: u32) -> BlockStored {
    BlockStored {
        block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
        parent_block_hash: parent.map(BlockHash::Int),
        token_ids: (first_token..first_token + BS * hashes.len() as u32).collect(),
        block_size: BS,
        medium: Some("GPU".into()),
        group_idx: Some(0),
        ..BlockStored::default()
    }
}

pub(super) fn removed(hashes: &[i128]) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
        medium: Some("GPU".into()),
        group_idx: Some(0),
        ..BlockRemoved::default()
    })
}

pub(super) fn put(index: &mut KvIndex, engine: u32, event: BlockStored) -> Applied {
    index.apply(EngineSlot(engine), &KvEvent::BlockStored(event))
}

pub(super) fn text(index: &KvIndex, tokens: std::ops::Range<u32>) -> Vec<(EngineSlot, usize)> {
    let tokens: Vec<u32> = tokens.collect();
    index.match_prefix(&RequestKey::default(), &tokens, BS as usize)
}

pub(super) fn sorted(mut runs: Vec<(EngineSlot, usize)>) -> Vec<(u32, usize)> {
    runs.sort();
    runs.into_iter().map(|(e, n)| (e.0, n)).collect()
}

pub(super) fn strs(values: &[&str]) -> Option<Vec<ExtraValue>> {
    Some(
        values
            .iter()
            .map(|v| ExtraValue::Str((*v).into()))
            .collect(),
    )
}

/// The events as an engine's wire carries them: encoded and decoded again.
pub(super) fn over_the_wire(events: Vec<KvEvent>) -> Vec<KvEvent> {
    let batch = EventBatch {
        ts: 0.0,
        events,
        data_parallel_rank: Some(0),
    };
    EventBatch::decode(&batch.encode()).expect("decodes").events
}

#[test]
fn store_match_remove_round_trip() {
    let mut idx = index();
    let applied = put(&mut idx, 0, stored(&[1, 2, 3], None, 0));
    assert_eq!((applied.stored, applied.ignored), (3, 0));
    assert_eq!(idx.engine_blocks(EngineSlot(0)), 3);
    assert_eq!(sorted(text(&idx, 0..12)), [(0, 3)]);
    assert_eq!(
        sorted(text(&idx, 0..15)),
        [(0, 3)],
        "a partial block does not count"
    );

    assert_eq!(idx.apply(EngineSlot(0), &removed(&[3])).removed, 1);
    assert_eq!(sorted(text(&idx, 0..12)), [(0, 2)]);
    assert_eq!(idx.apply(EngineSlot(0), &removed(&[1, 2])).removed, 2);
    assert_eq!(text(&idx, 0..12), []);
    let stats = idx.stats();
    assert_eq!((stats.blocks, stats.keys, stats.engines), (0, 0, vec![]));
}

#[test]
fn clearing_forgets_one_engine_only() {
    let mut idx = index();
    put(&mut idx, 0, stored(&[1, 2], None, 0));
    put(&mut idx, 1, stored(&[11, 12, 13], None, 0));
    let applied = idx.apply(EngineSlot(0), &KvEvent::AllBlocksCleared);
    assert_eq!(applied.removed, 2);
    assert_eq!(sorted(text(&idx, 0..12)), [(1, 3)]);
    assert_eq!(idx.stats().engines, [(EngineSlot(1), 3)]);
    assert_eq!(idx.clear_engine(EngineSlot(1)), 3);
    assert_eq!(idx.clear_engine(EngineSlot(7)), 0);
    assert_eq!((idx.stats().blocks, idx.stats().keys), (0, 0));
    // A cleared engine starts again from nothing.
    put(&mut idx, 0, stored(&[1], None, 0));
    assert_eq!(sorted(text(&idx, 0..8)), [(0, 1)]);
}

#[test]
fn same_tokens_under_another_parent_are_another_block() {
    let mut idx = index();
    put(&mut idx, 0, stored(&[1, 2], None, 0)); // tokens 0..8
    put(&mut idx, 1, stored(&[21], None, 4)); // tokens 4..8 as a first block
    put(&mut idx, 1, stored(&[22, 23], Some(21), 100)); // 100..108 after them
    put(&mut idx, 0, stored(&[3], Some(2), 100)); // 100..104 after 0..8
    assert_eq!(sorted(text(&idx, 0..8)), [(0, 2)]);
    assert_eq!(sorted(text(&idx, 4..8)), [(1, 1)]);
    let prompt: Vec<u32> = (4..8).chain(100..108).collect();
    let got = idx.match_prefix(&RequestKey::default(), &prompt, 4);
    assert_eq!(sorted(got), [(1, 3)]);
    let prompt: Vec<u32> = (0..8).chain(100..108).collect();
    let got = idx.match_prefix(&RequestKey::default(), &prompt, 4);
    assert_eq!(sorted(got), [(0, 3)]);
}

#[test]
fn engines_sharing_a_prefix() {
    let mut idx = index();
    put(&mut idx, 0, stored(&[1, 2], None, 0));
    put(&mut idx, 0, stored(&[3], Some(2), 100));
    put(&mut idx, 1, stored(&[11, 12], None, 0));
    put(&mut idx, 1, stored(&[13], Some(12), 200));
    let prompt: Vec<u32> = (0..8).chain(100..104).collect();
    let got = idx.match_prefix(&RequestKey::default(), &prompt, 4);
    assert_eq!(got[0], (EngineSlot(0), 3), "longest first");
    assert_eq!(sorted(got), [(0, 3), (1, 2)]);
    assert_eq!(idx.stats().keys, 4);
    idx.clear_engine(EngineSlot(0));
    assert_eq!(
        sorted(idx.match_prefix(&RequestKey::default(), &prompt, 4)),
        [(1, 2)]
    );
}

#[test]
fn blocks_after_an_unknown_parent_are_orphaned() {
    let mut idx = index();
    let applied = put(&mut idx, 0, stored(&[5, 6], Some(4), 16));
    assert_eq!((applied.orphaned, applied.stored), (2, 0));
    let applied = put(&mut idx, 0, stored(&[7], Some(6), 24));
    assert_eq!(applied.orphaned, 1, "a successor of an orphan is one too");
    assert_eq!(idx.stats().blocks, 0);
}

#[test]
fn unknown_removals_and_other_groups_are_ignored() {
    let mut idx = index();
    put(&mut idx, 0, stored(&[1, 2], None, 0));
    let applied = idx.apply(EngineSlot(0), &removed(&[9, 1]));
    assert_eq!((applied.removed, applied.ignored), (1, 1));
    assert_eq!(idx.apply(EngineSlot(3), &removed(&[2])).ignored, 1);
    let other_group = KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![BlockHash::Int(2)],
        medium: None,
        group_idx: Some(1),
        ..BlockRemoved::default()
    });
    assert_eq!(idx.apply(EngineSlot(0), &other_group).ignored, 1);
    assert_eq!(
        idx.apply(EngineSlot(0), &KvEvent::Unknown("X".into())),
        Applied::default()
    );
    assert_eq!(idx.engine_blocks(EngineSlot(0)), 1);
}

#[test]
fn only_full_attention_blocks_are_a_cached_prefix() {
    let mut idx = index();
    let of = |hashes: &[i128], group: u32, kind: &str| BlockStored {
        group_idx: Some(group),
        kv_cache_spec_kind: Some(kind.into()),
        ..stored(hashes, None, 0)
    };
    // A hybrid model whose group 0 is a sliding window and group 1 full attention.
    assert_eq!(
        put(&mut idx, 0, of(&[1, 2], 0, "sliding_window")).ignored,
        2
    );
    assert_eq!(
        put(&mut idx, 0, of(&[11, 12], 1, "full_attention")).stored,
        2
    );
    assert_eq!(put(&mut idx, 0, of(&[21], 2, "mamba")).ignored, 1);
    // Another full-attention group of the same tokens is not counted twice.
    assert_eq!(put(&mut idx, 0, of(&[31], 3, "mla_attention")).ignored, 1);
    assert_eq!(idx.engine_blocks(EngineSlot(0)), 2);
    // Removals name only their group: the indexed one's apply, group 0's do not.
    let removal = |group| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash::Int(11)],
            group_idx: Some(group),
            ..BlockRemoved::default()
        })
    };
    assert_eq!(idx.apply(EngineSlot(0), &removal(0)).ignored, 1);
    assert_eq!(idx.apply(EngineSlot(0), &removal(1)).removed, 1);
    // An engine that names no kinds keeps today's rule: group 0.
    assert_eq!(put(&mut idx, 1, stored(&[41], None, 0)).stored, 1);
    // A restart forgets what the engine named.
    idx.clear_engine(EngineSlot(0));
    assert_eq!(put(&mut idx, 0, of(&[51], 0, "full_attention")).stored, 1);
}

#[test]
fn incomplete_or_foreign_blocks_are_ignored() {
    let mut idx = KvIndex::new(KvIndexConfig {
        max_entries: 100,
        max_engines: 8,
    });
    let mut short = stored(&[1, 2, 3], None, 0);
    short.token_ids.truncate(10);
    let applied = put(&mut idx, 0, short);
    assert_eq!((applied.stored, applied.ignored), (2, 1));
    let mut long = stored(&[11], None, 0);
    long.token_ids.extend([90, 91]);
    assert_eq!(
        put(&mut idx, 1, long).stored,
        1,
        "trailing tokens are left out"
    );
    let mut group = stored(&[21], None, 0);
    group.group_idx = Some(1);
    assert_eq!(put(&mut idx, 2, group).ignored, 1);
    let mut no_size = stored(&[31], None, 0);
    no_size.block_size = 0;
    assert_eq!(put(&mut idx, 2, no_size).ignored, 1);
    let mut few_keys = stored(&[41, 42], None, 0);
    few_keys.extra_keys = vec![None];
    assert_eq!(put(&mut idx, 3, few_keys).ignored, 1);
    assert_eq!(put(&mut idx, 8, stored(&[51], None, 0)).ignored, 1);
    assert_eq!(sorted(text(&idx, 0..8)), [(0, 2), (1, 1), (3, 1)]);
}

#[test]
fn the_cap_evicts_the_least_recently_stored_or_confirmed() {
    let mut idx = KvIndex::new(KvIndexConfig {
        max_entries: 4,
        max_engines: 8,
    });
    put(&mut idx, 0, stored(&[1, 2], None, 0));
    put(&mut idx, 1, stored(&[11, 12], None, 100));
    // Engine 0 reuses its first block: vLLM announces it again, which confirms it.
    assert_eq!(put(&mut idx, 0, stored(&[1], None, 0)).evicted, 0);
    let applied = put(&mut idx, 1, stored(&[13], Some(12), 108));
    assert_eq!((applied.stored, applied.evicted), (1, 1));
    assert_eq!(
        sorted(text(&idx, 0..8)),
        [(0, 1)],
        "engine 0's second block went"
    );
    assert_eq!(sorted(text(&idx, 100..112)), [(1, 3)]);

    assert_eq!(put(&mut idx, 0, stored(&[2], Some(1), 4)).evicted, 1);
    assert_eq!(sorted(text(&idx, 0..8)), [(0, 2)]);
    assert_eq!(text(&idx, 100..112), [], "engine 1 lost its first block");
    let stats = idx.stats();
    assert_eq!((stats.blocks, stats.evictions), (4, 2));
    assert_eq!(stats.engines, [(EngineSlot(0), 2), (EngineSlot(1), 2)]);
}

#[test]
fn runs_are_consecutive_leading_blocks() {
    let mut idx = index();
    put(&mut idx, 0, stored(&[1, 2, 3, 4], None, 0));
    idx.apply(EngineSlot(0), &removed(&[3]));
    assert_eq!(
        sorted(text(&idx, 0..16)),
        [(0, 2)],
        "block 3 is held, after a gap"
    );
    idx.apply(EngineSlot(0), &removed(&[1]));
    assert_eq!(text(&idx, 0..16), []);
    assert_eq!(
        idx.match_prefix(&RequestKey::default(), &[0, 1, 2, 3], 0),
        []
    );
    put(&mut idx, 1, stored(&[7], None, 0));
    let tokens: Vec<u32> = (0..8).collect();
    assert_eq!(
        idx.match_prefix(&RequestKey::default(), &tokens, 8),
        [],
        "another size"
    );
}

#[test]
fn bytes_hashes_and_restored_hashes() {
    let mut idx = index();
    let mut event = stored(&[0], None, 0);
    event.block_hashes = vec![BlockHash::Bytes(Box::from(&[7u8; 32][..]))];
    put(&mut idx, 0, event.clone());
    assert_eq!(sorted(text(&idx, 0..4)), [(0, 1)]);
    // The same engine hash stored again with other tokens: the new content replaces the old.
    event.token_ids = vec![9, 9, 9, 9];
    put(&mut idx, 0, event.clone());
    assert_eq!(text(&idx, 0..4), []);
    assert_eq!(
        sorted(idx.match_prefix(&RequestKey::default(), &[9, 9, 9, 9], 4)),
        [(0, 1)]
    );
    let gone = KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: event.block_hashes,
        medium: None,
        group_idx: None,
        ..BlockRemoved::default()
    });
    assert_eq!(idx.apply(EngineSlot(0), &gone).removed, 1);
    assert_eq!(idx.stats().keys, 0);
}

#[test]
fn many_engines_match_like_a_naive_scan() {
    let mut idx = index();
    let engines = 300u32;
    for e in 0..engines {
        let base = i128::from(e) * 100;
        let hashes: Vec<i128> = (1..=6).map(|b| base + b).collect();
        put(&mut idx, e, stored(&hashes, None, 0));
        // Each engine lacks the block at e % 7 (none when 6), from then its run stops.
        if e % 7 < 6 {
            idx.apply(EngineSlot(e), &removed(&[base + 1 + i128::from(e % 7)]));
        }
    }
    let got = text(&idx, 0..24);
    for pair in got.windows(2) {
        assert!(pair[0].1 >= pair[1].1, "longest first");
    }
    let expected: Vec<(u32, usize)> = (0..engines)
        .map(|e| (e, (e % 7) as usize))
        .filter(|&(_, run)| run > 0)
        .collect();
    assert_eq!(sorted(got), expected);
    // Down to a few holders again, then to none.
    for e in 3..engines {
        idx.clear_engine(EngineSlot(e));
    }
    assert_eq!(sorted(text(&idx, 0..24)), [(1, 1), (2, 2)]);
    for e in 0..3 {
        idx.clear_engine(EngineSlot(e));
    }
    assert_eq!((idx.stats().blocks, idx.stats().keys), (0, 0));
}

#[test]
fn memory_per_pair_is_small() {
    let mut idx = index();
    for e in 0..10u32 {
        let hashes: Vec<i128> = (0..10_000).map(|b| (i128::from(e) << 32) | b).collect();
        let mut event = stored(&hashes, None, e * 1_000_000);
        event.block_size = 1;
        event.token_ids.truncate(hashes.len());
        assert_eq!(put(&mut idx, e, event).stored, 10_000);
    }
    let stats = idx.stats();
    assert_eq!((stats.blocks, stats.keys), (100_000, 100_000));
    let per_pair = stats.bytes / stats.blocks;
    assert!((32..=150).contains(&per_pair), "{per_pair} bytes per pair");
}
