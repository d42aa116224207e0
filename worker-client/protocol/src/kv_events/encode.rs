//! Writing a payload as vLLM 0.32 does (events as maps with a `type` key). vLLM's events are
//! msgspec structs with `omit_defaults`: a field without a default (`BlockStored`'s `lora_id`,
//! `medium`, `lora_name`; `BlockRemoved`'s `medium`) is always written, `nil` when unset, and
//! vLLM's own decoder refuses a payload without it; fields with defaults are left out unset.

use super::{BlockHash, EventBatch, ExtraValue, KvEvent};

impl EventBatch {
    /// Encodes the batch as vLLM 0.32 does: events as maps with a `type` key, required fields
    /// always (`nil` when unset), defaulted ones only when set.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + 16 * self.events.len());
        let w = &mut out;
        let items = if self.data_parallel_rank.is_some() {
            3
        } else {
            2
        };
        write(rmp::encode::write_array_len(w, items));
        write(rmp::encode::write_f64(w, self.ts));
        write(rmp::encode::write_array_len(w, self.events.len() as u32));
        for event in &self.events {
            encode_event(w, event);
        }
        if let Some(rank) = self.data_parallel_rank {
            write(rmp::encode::write_uint(w, rank.into()));
        }
        out
    }
}

/// Writing into a `Vec` cannot fail.
fn write<T, E: std::fmt::Debug>(result: Result<T, E>) {
    result.expect("writing into memory does not fail");
}

fn encode_str(w: &mut Vec<u8>, s: &str) {
    write(rmp::encode::write_str(w, s));
}

fn encode_opt_str(w: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => encode_str(w, s),
        None => write(rmp::encode::write_nil(w)),
    }
}

/// The defaulted string fields that are set, each as its name and value.
fn encode_named(w: &mut Vec<u8>, fields: &[(&str, Option<&str>)]) {
    for (name, value) in fields {
        if let Some(value) = value {
            encode_str(w, name);
            encode_str(w, value);
        }
    }
}

fn encode_int(w: &mut Vec<u8>, n: i128) {
    match u64::try_from(n) {
        Ok(n) => write(rmp::encode::write_uint(w, n)),
        Err(_) => write(rmp::encode::write_sint(w, n as i64)),
    }
}

fn encode_hash(w: &mut Vec<u8>, hash: &BlockHash) {
    match hash {
        BlockHash::Int(n) => encode_int(w, *n),
        BlockHash::Bytes(b) => write(rmp::encode::write_bin(w, b)),
    }
}

fn encode_hashes(w: &mut Vec<u8>, hashes: &[BlockHash]) {
    write(rmp::encode::write_array_len(w, hashes.len() as u32));
    hashes.iter().for_each(|h| encode_hash(w, h));
}

fn encode_value(w: &mut Vec<u8>, value: &ExtraValue) {
    match value {
        ExtraValue::Nil => write(rmp::encode::write_nil(w)),
        ExtraValue::Bool(b) => write(rmp::encode::write_bool(w, *b)),
        ExtraValue::Int(n) => encode_int(w, *n),
        ExtraValue::Str(s) => encode_str(w, s),
        ExtraValue::Bytes(b) => write(rmp::encode::write_bin(w, b)),
        ExtraValue::List(items) => {
            write(rmp::encode::write_array_len(w, items.len() as u32));
            items.iter().for_each(|item| encode_value(w, item));
        }
    }
}

fn encode_event(w: &mut Vec<u8>, event: &KvEvent) {
    match event {
        KvEvent::BlockStored(s) => {
            // vLLM 0.32's defaulted fields, in its order (it has no lookahead tokens).
            let named = [
                ("kv_cache_spec_kind", s.kv_cache_spec_kind.as_deref()),
                ("locality", s.locality.as_deref()),
                ("ownership", s.ownership.as_deref()),
                ("session_id", s.session_id.as_deref()),
            ];
            let optional = [
                !s.extra_keys.is_empty(),
                s.group_idx.is_some(),
                s.kv_cache_spec_sliding_window.is_some(),
            ];
            let fields = 8
                + optional.iter().filter(|f| **f).count() as u32
                + named.iter().filter(|(_, v)| v.is_some()).count() as u32;
            write(rmp::encode::write_map_len(w, fields));
            encode_str(w, "type");
            encode_str(w, "BlockStored");
            encode_str(w, "block_hashes");
            encode_hashes(w, &s.block_hashes);
            encode_str(w, "parent_block_hash");
            match &s.parent_block_hash {
                Some(hash) => encode_hash(w, hash),
                None => write(rmp::encode::write_nil(w)),
            }
            encode_str(w, "token_ids");
            write(rmp::encode::write_array_len(w, s.token_ids.len() as u32));
            s.token_ids.iter().for_each(|t| encode_int(w, (*t).into()));
            encode_str(w, "block_size");
            encode_int(w, s.block_size.into());
            encode_str(w, "lora_id");
            match s.lora_id {
                Some(id) => encode_int(w, id.into()),
                None => write(rmp::encode::write_nil(w)),
            }
            encode_str(w, "medium");
            encode_opt_str(w, s.medium.as_deref());
            encode_str(w, "lora_name");
            encode_opt_str(w, s.lora_name.as_deref());
            if !s.extra_keys.is_empty() {
                encode_str(w, "extra_keys");
                write(rmp::encode::write_array_len(w, s.extra_keys.len() as u32));
                for key in &s.extra_keys {
                    match key {
                        Some(values) => encode_value(w, &ExtraValue::List(values.clone())),
                        None => write(rmp::encode::write_nil(w)),
                    }
                }
            }
            if let Some(group) = s.group_idx {
                encode_str(w, "group_idx");
                encode_int(w, group.into());
            }
            if let Some(window) = s.kv_cache_spec_sliding_window {
                encode_str(w, "kv_cache_spec_sliding_window");
                encode_int(w, window.into());
            }
            encode_named(w, &named);
        }
        KvEvent::BlockRemoved(r) => {
            let named = [
                ("locality", r.locality.as_deref()),
                ("ownership", r.ownership.as_deref()),
            ];
            let set = named.iter().filter(|(_, v)| v.is_some()).count() as u32;
            let fields = 3 + u32::from(r.group_idx.is_some()) + set;
            write(rmp::encode::write_map_len(w, fields));
            encode_str(w, "type");
            encode_str(w, "BlockRemoved");
            encode_str(w, "block_hashes");
            encode_hashes(w, &r.block_hashes);
            encode_str(w, "medium");
            encode_opt_str(w, r.medium.as_deref());
            if let Some(group) = r.group_idx {
                encode_str(w, "group_idx");
                encode_int(w, group.into());
            }
            encode_named(w, &named);
        }
        KvEvent::AllBlocksCleared => {
            write(rmp::encode::write_map_len(w, 1));
            encode_str(w, "type");
            encode_str(w, "AllBlocksCleared");
        }
        KvEvent::Unknown(kind) => {
            write(rmp::encode::write_map_len(w, 1));
            encode_str(w, "type");
            encode_str(w, kind);
        }
    }
}
