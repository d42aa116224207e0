//! The request side against what vLLM publishes: LoRA names, cache salts, multimodal keys,
//! and a payload vLLM's own classes wrote.

use pd_protocol::kv_events::{EventBatch, ExtraValue, KvEvent};

use super::tests::{index, over_the_wire, put, sorted, stored, strs, text};
use super::{Applied, EngineSlot, RequestKey};

#[test]
fn lora_names_and_salts_keep_blocks_apart() {
    let mut idx = index();
    put(&mut idx, 0, stored(&[1, 2], None, 0));
    let mut lora = stored(&[1, 2], None, 0);
    lora.lora_name = Some("ad".into());
    lora.extra_keys = vec![strs(&["ad"]), strs(&["ad"])];
    put(&mut idx, 1, lora.clone());
    let mut other = lora.clone();
    other.lora_name = Some("other".into());
    other.extra_keys = vec![strs(&["other"]), strs(&["other"])];
    put(&mut idx, 2, other);
    let mut salted = stored(&[1, 2], None, 0);
    salted.extra_keys = vec![strs(&["s"]), None];
    put(&mut idx, 3, salted);
    let mut both = lora;
    both.extra_keys = vec![strs(&["ad", "s"]), strs(&["ad"])];
    put(&mut idx, 4, both);

    let tokens: Vec<u32> = (0..8).collect();
    let run = |lora_name, cache_salt| {
        let key = RequestKey {
            lora_name,
            cache_salt,
        };
        sorted(idx.match_prefix(&key, &tokens, 4))
    };
    assert_eq!(run(None, None), [(0, 2)]);
    assert_eq!(run(None, Some("")), [(0, 2)], "an empty salt is no salt");
    assert_eq!(run(Some("ad"), None), [(1, 2)]);
    assert_eq!(run(Some("other"), None), [(2, 2)]);
    assert_eq!(run(None, Some("s")), [(3, 2)]);
    assert_eq!(run(Some("ad"), Some("s")), [(4, 2)]);
    assert_eq!(run(None, Some("t")), []);
}

/// The shapes vLLM 0.32 publishes (checked against its `generate_block_hash_extra_keys` and
/// `to_event_extra_keys`): LoRA "ad" with salt "s": `[("ad", "s"), ("ad",)]`; salt only:
/// `[("s",), None]`; neither: `[None, None]`; before `extra_keys` existed: nothing.
#[test]
fn request_keys_equal_the_keys_of_vllm_events() {
    type ExtraKeys = Vec<Option<Vec<ExtraValue>>>;
    let cases: [(Option<&str>, Option<&str>, ExtraKeys); 4] = [
        (
            Some("ad"),
            Some("s"),
            vec![strs(&["ad", "s"]), strs(&["ad"])],
        ),
        (None, Some("s"), vec![strs(&["s"]), None]),
        (Some("ad"), None, vec![strs(&["ad"]), strs(&["ad"])]),
        (None, None, vec![None, None]),
    ];
    let tokens: Vec<u32> = (0..8).collect();
    for (i, (lora_name, cache_salt, extra_keys)) in cases.into_iter().enumerate() {
        let mut event = stored(&[1, 2], None, 0);
        event.lora_name = lora_name.map(Into::into);
        event.lora_id = lora_name.map(|_| 1);
        event.extra_keys = extra_keys;
        let mut idx = index();
        for event in over_the_wire(vec![KvEvent::BlockStored(event)]) {
            assert_eq!(idx.apply(EngineSlot(0), &event).stored, 2);
        }
        let key = RequestKey {
            lora_name,
            cache_salt,
        };
        assert_eq!(
            sorted(idx.match_prefix(&key, &tokens, 4)),
            [(0, 2)],
            "case {i}"
        );
    }
    // An engine publishing no extra keys: unsalted base requests match.
    let mut idx = index();
    put(&mut idx, 0, stored(&[1, 2], None, 0));
    assert_eq!(sorted(text(&idx, 0..8)), [(0, 2)]);
}

#[test]
fn the_fixture_vllm_wrote_is_indexed() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../worker-client/protocol/tests/fixtures/kv_events/vllm-0.32.msgpack"
    );
    let batch = EventBatch::decode(&std::fs::read(path).expect("fixture")).expect("decodes");
    let mut idx = index();
    let applied: Vec<Applied> = (batch.events.iter())
        .map(|e| idx.apply(EngineSlot(0), e))
        .collect();
    // Two salted blocks, one LoRA block with an image after them, a removal of the first and
    // the third, then everything cleared.
    assert_eq!([applied[0].stored, applied[1].stored], [2, 1]);
    assert_eq!((applied[2].removed, applied[3].removed), (2, 1));

    let mut idx = index();
    for e in &batch.events[..2] {
        idx.apply(EngineSlot(0), e);
    }
    let tokens: Vec<u32> = (0..96).collect();
    let salted = RequestKey {
        lora_name: None,
        cache_salt: Some("salt-a"),
    };
    assert_eq!(sorted(idx.match_prefix(&salted, &tokens, 32)), [(0, 2)]);
    assert_eq!(idx.match_prefix(&RequestKey::default(), &tokens, 32), []);
}

#[test]
fn multimodal_blocks_match_no_text_request() {
    let mut idx = index();
    let mut event = stored(&[1, 2], None, 0);
    let mm = ExtraValue::List(vec![ExtraValue::Str("mm-hash".into()), ExtraValue::Int(0)]);
    event.extra_keys = vec![None, Some(vec![mm])];
    put(&mut idx, 0, event);
    assert_eq!(sorted(text(&idx, 0..8)), [(0, 1)]);
}
