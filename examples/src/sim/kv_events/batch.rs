//! The events of one change to a prefix cache, in vLLM's shapes (`block_pool.py`): the
//! consecutive blocks a prompt stored in one `BlockStored` (parent hash, token ids, block size,
//! LoRA, medium `GPU`, one `extra_keys` entry per block, group 0), one `BlockRemoved` per
//! evicted block, `AllBlocksCleared` at a reset. Hashes are published as integers, as vLLM
//! publishes them by default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).

use pd_protocol::kv_events::{BlockHash, BlockRemoved, BlockStored, ExtraValue, KvEvent};

use crate::sim::lora::Adapter;

/// Where the blocks are, as vLLM names its own KV cache.
const MEDIUM: &str = "GPU";

/// One stored block.
#[derive(Debug, Clone, Copy)]
pub struct StoredBlock<'a> {
    /// Its hash.
    pub hash: u64,
    /// The hash of the block before it in the prompt, none for the first.
    pub parent: Option<u64>,
    /// Its token ids.
    pub tokens: &'a [u32],
    /// The LoRA adapter the prompt was computed with.
    pub lora: Option<&'a Adapter>,
    /// What else its hash mixes in, as vLLM publishes it (`None`: nothing).
    pub extra_keys: Option<&'a [&'a str]>,
}

/// The events of one change, in order.
#[derive(Debug, Default)]
pub struct Batch {
    events: Vec<KvEvent>,
}

fn int(hash: u64) -> BlockHash {
    BlockHash::Int(hash.into())
}

impl Batch {
    /// A block stored: appended to the `BlockStored` before it when it follows that event's
    /// last block, else a new event.
    pub fn stored(&mut self, block: StoredBlock<'_>, block_size: u32) {
        let extra = block
            .extra_keys
            .map(|keys| keys.iter().map(|k| ExtraValue::Str((*k).into())).collect());
        if let Some(KvEvent::BlockStored(last)) = self.events.last_mut() {
            let follows = block.parent.map(int).as_ref() == last.block_hashes.last();
            let lora_name = block.lora.map(|lora| lora.name.as_str());
            if follows && last.lora_name.as_deref() == lora_name {
                last.block_hashes.push(int(block.hash));
                last.token_ids.extend_from_slice(block.tokens);
                last.extra_keys.push(extra);
                return;
            }
        }
        self.events.push(KvEvent::BlockStored(BlockStored {
            block_hashes: vec![int(block.hash)],
            parent_block_hash: block.parent.map(int),
            token_ids: block.tokens.to_vec(),
            block_size,
            lora_id: block.lora.map(|lora| lora.id),
            medium: Some(MEDIUM.into()),
            lora_name: block.lora.map(|lora| lora.name.clone()),
            extra_keys: vec![extra],
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            ..BlockStored::default()
        }));
    }

    /// A block evicted.
    pub fn removed(&mut self, hash: u64) {
        self.events.push(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![int(hash)],
            medium: Some(MEDIUM.into()),
            group_idx: Some(0),
            ..BlockRemoved::default()
        }));
    }

    /// Every block dropped.
    pub fn cleared(&mut self) {
        self.events.push(KvEvent::AllBlocksCleared);
    }

    /// The events.
    pub fn into_events(self) -> Vec<KvEvent> {
        self.events
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(hash: u64, parent: Option<u64>) -> StoredBlock<'static> {
        StoredBlock {
            hash,
            parent,
            tokens: &[1, 2],
            lora: None,
            extra_keys: None,
        }
    }

    #[test]
    fn a_run_of_blocks_is_one_event_and_a_removal_breaks_it() {
        let mut batch = Batch::default();
        batch.stored(block(1, None), 2);
        batch.stored(block(2, Some(1)), 2);
        batch.removed(9);
        batch.stored(block(3, Some(2)), 2);
        let events = batch.into_events();
        let KvEvent::BlockStored(first) = &events[0] else {
            panic!("{events:?}")
        };
        assert_eq!(first.block_hashes, vec![int(1), int(2)]);
        assert_eq!(
            (first.parent_block_hash.clone(), first.token_ids.len()),
            (None, 4)
        );
        assert_eq!(first.extra_keys, vec![None, None]);
        assert!(matches!(&events[1], KvEvent::BlockRemoved(r) if r.block_hashes == [int(9)]));
        let KvEvent::BlockStored(next) = &events[2] else {
            panic!("{events:?}")
        };
        assert_eq!(next.parent_block_hash, Some(int(2)));
    }

    #[test]
    fn an_adapter_and_a_salt_are_published_as_vllm_does() {
        let mut batch = Batch::default();
        let keys = ["ad", "salt"];
        let adapter = Adapter {
            name: "ad".into(),
            path: "/adapters/ad".into(),
            id: 3,
        };
        let first = StoredBlock {
            lora: Some(&adapter),
            extra_keys: Some(&keys),
            ..block(1, None)
        };
        batch.stored(first, 2);
        let KvEvent::BlockStored(stored) = &batch.into_events()[0] else {
            panic!()
        };
        assert_eq!(stored.lora_name.as_deref(), Some("ad"));
        assert_eq!(stored.lora_id, Some(3));
        assert_eq!(
            stored.extra_keys,
            vec![Some(vec![
                ExtraValue::Str("ad".into()),
                ExtraValue::Str("salt".into())
            ])]
        );
    }
}
