//! Decoding vLLM's KV cache events from payloads vLLM's own classes wrote (both encodings:
//! `tests/fixtures/kv_events/make_fixtures.py`), encoding them back, and refusing malformed
//! input without panicking or allocating more than the input.

use pd_protocol::kv_events::{BlockHash, EventBatch, ExtraValue, KvEvent};
use serde_json::{json, Value};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kv_events");

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}/{name}.msgpack")).unwrap()
}

fn expected(name: &str) -> Value {
    let all: Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{FIXTURES}/expected.json")).unwrap(),
    )
    .unwrap();
    all[name].clone()
}

fn hash_json(hash: &BlockHash) -> Value {
    match hash {
        BlockHash::Int(n) => json!({"int": *n as i64}),
        BlockHash::Bytes(b) => {
            json!({"bytes": b.iter().map(|b| format!("{b:02x}")).collect::<String>()})
        }
    }
}

fn value_json(value: &ExtraValue) -> Value {
    match value {
        ExtraValue::Nil => Value::Null,
        ExtraValue::Bool(b) => json!(b),
        ExtraValue::Int(n) => json!(*n as i64),
        ExtraValue::Str(s) => json!(s),
        ExtraValue::Bytes(b) => json!(b.to_vec()),
        ExtraValue::List(items) => Value::Array(items.iter().map(value_json).collect()),
    }
}

/// The batch in expected.json's shape.
fn as_json(batch: &EventBatch) -> Value {
    let events: Vec<Value> = batch
        .events
        .iter()
        .map(|event| match event {
            KvEvent::BlockStored(s) => json!({
                "type": "BlockStored",
                "block_hashes": s.block_hashes.iter().map(hash_json).collect::<Vec<_>>(),
                "parent_block_hash": s.parent_block_hash.as_ref().map(hash_json),
                "token_ids": s.token_ids,
                "block_size": s.block_size,
                "lora_name": s.lora_name,
                "medium": s.medium,
                "extra_keys": s.extra_keys.iter().map(|k| k.as_ref().map(|v| value_json(&ExtraValue::List(v.clone())))).collect::<Vec<_>>(),
            }),
            KvEvent::BlockRemoved(r) => json!({
                "type": "BlockRemoved",
                "block_hashes": r.block_hashes.iter().map(hash_json).collect::<Vec<_>>(),
                "medium": r.medium,
            }),
            KvEvent::AllBlocksCleared => json!({"type": "AllBlocksCleared"}),
            KvEvent::Unknown(kind) => json!({"type": kind}),
        })
        .collect();
    json!({"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank, "events": events})
}

#[test]
fn both_of_vllms_encodings_decode_to_what_vllm_wrote() {
    for name in ["vllm-0.32", "vllm-0.11"] {
        let batch =
            EventBatch::decode(&fixture(name)).unwrap_or_else(|err| panic!("{name}: {err}"));
        assert_eq!(as_json(&batch), expected(name), "{name}");
    }
    // The fields only the map form has.
    let batch = EventBatch::decode(&fixture("vllm-0.32")).unwrap();
    let KvEvent::BlockStored(first) = &batch.events[0] else {
        panic!("{batch:?}")
    };
    assert_eq!((first.group_idx, first.lora_id), (Some(0), None));
    // vLLM 0.32's cache-spec and session fields, as its encoder wrote them.
    assert_eq!(first.kv_cache_spec_kind.as_deref(), Some("full_attention"));
    assert_eq!(first.session_id.as_deref(), Some("session-1"));
    assert!(first.is_full_attention());
    let KvEvent::BlockStored(next) = &batch.events[1] else {
        panic!("{batch:?}")
    };
    assert_eq!(
        (next.lora_id, next.lora_name.as_deref()),
        (Some(7), Some("adapter-a"))
    );
    assert_eq!(next.locality.as_deref(), Some("LOCAL"));
    assert_eq!(
        (
            next.kv_cache_spec_kind.as_deref(),
            next.session_id.as_deref()
        ),
        (None, None)
    );
}

#[test]
fn vllm_0_33s_block_fields_are_read_and_kinds_classified() {
    let event = json!({"type": "BlockStored", "block_hashes": [5], "parent_block_hash": null,
        "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": null, "medium": "GPU",
        "lora_name": null, "group_idx": 1, "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 4096, "locality": "REMOTE", "ownership": "tier-2",
        "session_id": "s-9", "lookahead_token_ids": [7, 8]});
    let removed = json!({"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU",
        "group_idx": 1, "locality": "LOCAL", "ownership": "tier-2"});
    let batch = EventBatch::decode(&msgpack(&json!([2.5, [event, removed], 0]))).unwrap();
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("{batch:?}")
    };
    assert_eq!(stored.kv_cache_spec_sliding_window, Some(4096));
    assert_eq!(
        (stored.locality.as_deref(), stored.ownership.as_deref()),
        (Some("REMOTE"), Some("tier-2"))
    );
    assert_eq!(
        (
            stored.session_id.as_deref(),
            &stored.lookahead_token_ids[..]
        ),
        (Some("s-9"), &[7, 8][..])
    );
    assert!(
        !stored.is_full_attention(),
        "a sliding window is no cached prefix"
    );
    let KvEvent::BlockRemoved(gone) = &batch.events[1] else {
        panic!("{batch:?}")
    };
    assert_eq!(
        (gone.locality.as_deref(), gone.ownership.as_deref()),
        (Some("LOCAL"), Some("tier-2"))
    );
    // What this crate writes, vLLM's fields, reads back the same (the lookahead is not vLLM
    // 0.32's: not written).
    let mut expected = batch.clone();
    if let KvEvent::BlockStored(stored) = &mut expected.events[0] {
        stored.lookahead_token_ids.clear();
    }
    assert_eq!(EventBatch::decode(&batch.encode()).unwrap(), expected);
    for kind in ["full_attention", "mla_attention", "sink_full_attention"] {
        let named = pd_protocol::kv_events::BlockStored {
            kv_cache_spec_kind: Some(kind.into()),
            ..Default::default()
        };
        assert!(named.is_full_attention(), "{kind}");
    }
    for kind in [
        "mamba",
        "chunked_local_attention",
        "encoder_only_attention",
        "cross_attention",
        "unknown",
    ] {
        let named = pd_protocol::kv_events::BlockStored {
            kv_cache_spec_kind: Some(kind.into()),
            ..Default::default()
        };
        assert!(!named.is_full_attention(), "{kind}");
    }
}

#[test]
fn encoded_batches_decode_to_themselves() {
    for name in ["vllm-0.32", "vllm-0.11"] {
        let batch = EventBatch::decode(&fixture(name)).unwrap();
        let again = EventBatch::decode(&batch.encode()).unwrap();
        assert_eq!(again, batch, "{name}");
    }
    let unranked = EventBatch {
        ts: 1.5,
        events: vec![KvEvent::AllBlocksCleared],
        data_parallel_rank: None,
    };
    assert_eq!(EventBatch::decode(&unranked.encode()).unwrap(), unranked);
}

/// msgpack of `value` (a JSON stand-in: what matters is the structure).
fn msgpack(value: &Value) -> Vec<u8> {
    fn put(out: &mut Vec<u8>, value: &Value) {
        match value {
            Value::Null => rmp::encode::write_nil(out).unwrap(),
            Value::Bool(b) => rmp::encode::write_bool(out, *b).unwrap(),
            Value::Number(n) if n.is_f64() => {
                rmp::encode::write_f64(out, n.as_f64().unwrap()).unwrap()
            }
            Value::Number(n) => {
                rmp::encode::write_sint(out, n.as_i64().unwrap()).unwrap();
            }
            Value::String(s) => rmp::encode::write_str(out, s).unwrap(),
            Value::Array(items) => {
                rmp::encode::write_array_len(out, items.len() as u32).unwrap();
                items.iter().for_each(|item| put(out, item));
            }
            Value::Object(map) => {
                rmp::encode::write_map_len(out, map.len() as u32).unwrap();
                for (key, item) in map {
                    rmp::encode::write_str(out, key).unwrap();
                    put(out, item);
                }
            }
        }
    }
    let mut out = Vec::new();
    put(&mut out, value);
    out
}

#[test]
fn unknown_fields_and_event_types_do_not_fail_a_batch() {
    let payload = msgpack(&json!([2.5, [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": null, "token_ids": [5, 6],
         "block_size": 2, "medium": "GPU", "new_field": {"nested": [1, [2, {"deep": true}]]}},
        {"type": "BlockMoved", "block_hashes": [1], "to": "CPU"},
        ["BlockRemoved", [1], "GPU", 0, "a later positional field"],
        ["SomethingNew", 1, 2, [3]]
    ], 0]));
    let batch = EventBatch::decode(&payload).unwrap();
    assert_eq!(batch.events.len(), 4);
    assert!(matches!(&batch.events[0], KvEvent::BlockStored(s) if s.token_ids == [5, 6]));
    assert_eq!(batch.events[1], KvEvent::Unknown("BlockMoved".into()));
    assert!(matches!(&batch.events[2], KvEvent::BlockRemoved(r) if r.group_idx == Some(0)));
    assert_eq!(batch.events[3], KvEvent::Unknown("SomethingNew".into()));
}

#[test]
fn malformed_payloads_are_errors_not_panics() {
    for name in ["vllm-0.32", "vllm-0.11"] {
        let payload = fixture(name);
        // Every truncation.
        for end in 0..payload.len() {
            assert!(
                EventBatch::decode(&payload[..end]).is_err(),
                "{name} cut at {end}"
            );
        }
        // Every byte replaced by a few troublesome values: whatever it gives, it returns.
        for at in 0..payload.len() {
            for byte in [0x00, 0x7f, 0x90, 0xc1, 0xdc, 0xdd, 0xdf, 0xff] {
                let mut broken = payload.clone();
                broken[at] = byte;
                let _ = EventBatch::decode(&broken);
            }
        }
    }
    let refused = [
        // An array announcing 4 billion events in a few bytes: refused, nothing allocated.
        vec![
            0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x00,
        ],
        // A token id that is not one.
        msgpack(&json!([
            1.0,
            [["BlockStored", [1], null, [-1], 1, null, null]]
        ])),
        // A map event without a type.
        msgpack(&json!([1.0, [{"block_hashes": [1]}]])),
        // Bytes after the batch.
        [msgpack(&json!([1.0, []])), vec![0xc0]].concat(),
    ];
    for payload in refused {
        assert!(EventBatch::decode(&payload).is_err(), "{payload:02x?}");
    }
    // Extra keys nested deeper than the limit.
    let mut deep = json!("salt");
    for _ in 0..40 {
        deep = json!([deep]);
    }
    let payload = msgpack(&json!([1.0, [{"type": "BlockStored", "block_hashes": [1],
        "parent_block_hash": null, "token_ids": [1], "block_size": 1, "extra_keys": [deep]}]]));
    assert!(EventBatch::decode(&payload).is_err());
}
