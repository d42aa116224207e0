//! Reading a payload: a cursor over msgpack values (rmp reads the markers and numbers), the
//! two event encodings, and the limits (allocations bounded by the input, nesting by
//! [`MAX_DEPTH`]).

use rmp::decode::{Bytes, RmpRead};
use rmp::Marker;

use super::{
    BlockHash, BlockRemoved, BlockStored, DecodeError, EventBatch, ExtraValue, KvEvent, MAX_DEPTH,
};

fn bad<T>(what: impl Into<String>) -> Result<T, DecodeError> {
    Err(DecodeError(what.into()))
}

/// A msgpack value's head: its marker, read.
enum Head<'a> {
    Nil,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext,
}

/// A reader over a payload.
struct Reader<'a> {
    input: Bytes<'a>,
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize) -> Result<&'a [u8], DecodeError> {
        let rest = self.input.remaining_slice();
        if rest.len() < len {
            return bad(format!("{len} bytes announced, {} left", rest.len()));
        }
        let (taken, tail) = rest.split_at(len);
        self.input = Bytes::new(tail);
        Ok(taken)
    }

    fn len(&mut self, width: usize) -> Result<usize, DecodeError> {
        let bytes = self.take(width)?;
        Ok(bytes.iter().fold(0usize, |n, b| (n << 8) | usize::from(*b)))
    }

    fn head(&mut self) -> Result<Head<'a>, DecodeError> {
        let truncated = |_| DecodeError("truncated".into());
        let marker = rmp::decode::read_marker(&mut self.input)
            .map_err(|_| DecodeError("truncated".into()))?;
        let i = &mut self.input;
        Ok(match marker {
            Marker::Null => Head::Nil,
            Marker::True => Head::Bool(true),
            Marker::False => Head::Bool(false),
            Marker::FixPos(n) => Head::Int(n.into()),
            Marker::FixNeg(n) => Head::Int(n.into()),
            Marker::U8 => Head::Int(i.read_data_u8().map_err(truncated)?.into()),
            Marker::U16 => Head::Int(i.read_data_u16().map_err(truncated)?.into()),
            Marker::U32 => Head::Int(i.read_data_u32().map_err(truncated)?.into()),
            Marker::U64 => Head::Int(i.read_data_u64().map_err(truncated)?.into()),
            Marker::I8 => Head::Int(i.read_data_i8().map_err(truncated)?.into()),
            Marker::I16 => Head::Int(i.read_data_i16().map_err(truncated)?.into()),
            Marker::I32 => Head::Int(i.read_data_i32().map_err(truncated)?.into()),
            Marker::I64 => Head::Int(i.read_data_i64().map_err(truncated)?.into()),
            Marker::F32 => Head::Float(i.read_data_f32().map_err(truncated)?.into()),
            Marker::F64 => Head::Float(i.read_data_f64().map_err(truncated)?),
            Marker::FixStr(n) => Head::Str(self.take(n.into())?),
            Marker::Str8
            | Marker::Bin8
            | Marker::Str16
            | Marker::Bin16
            | Marker::Str32
            | Marker::Bin32 => {
                let width = match marker {
                    Marker::Str8 | Marker::Bin8 => 1,
                    Marker::Str16 | Marker::Bin16 => 2,
                    _ => 4,
                };
                let len = self.len(width)?;
                let data = self.take(len)?;
                match marker {
                    Marker::Str8 | Marker::Str16 | Marker::Str32 => Head::Str(data),
                    _ => Head::Bin(data),
                }
            }
            Marker::FixArray(n) => Head::Array(n.into()),
            Marker::Array16 => Head::Array(self.len(2)? as u32),
            Marker::Array32 => Head::Array(self.len(4)? as u32),
            Marker::FixMap(n) => Head::Map(n.into()),
            Marker::Map16 => Head::Map(self.len(2)? as u32),
            Marker::Map32 => Head::Map(self.len(4)? as u32),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 | Marker::Ext16 | Marker::Ext32 => {
                let width = match marker {
                    Marker::Ext8 => 1,
                    Marker::Ext16 => 2,
                    _ => 4,
                };
                let len = self.len(width)?;
                self.ext(len)?
            }
            Marker::Reserved => return bad("reserved marker 0xc1"),
        })
    }

    /// Skips an extension's type byte and `len` bytes of data.
    fn ext(&mut self, len: usize) -> Result<Head<'a>, DecodeError> {
        self.take(1 + len)?;
        Ok(Head::Ext)
    }

    /// Skips one whole value.
    fn skip(&mut self, depth: usize) -> Result<(), DecodeError> {
        match self.head()? {
            Head::Array(n) => self.skip_items(n as usize, depth),
            Head::Map(n) => self.skip_items(2 * n as usize, depth),
            _ => Ok(()),
        }
    }

    fn skip_items(&mut self, n: usize, depth: usize) -> Result<(), DecodeError> {
        if depth >= MAX_DEPTH {
            return bad("nested too deep");
        }
        (0..n).try_for_each(|_| self.skip(depth + 1))
    }

    /// The capacity for `n` items: never more than the bytes left (each takes one at least).
    fn capacity(&self, n: u32) -> usize {
        (n as usize).min(self.input.remaining_slice().len())
    }

    fn array(&mut self, what: &str) -> Result<u32, DecodeError> {
        match self.head()? {
            Head::Array(n) => Ok(n),
            _ => bad(format!("{what} is not an array")),
        }
    }

    fn int(&mut self, what: &str) -> Result<i128, DecodeError> {
        match self.head()? {
            Head::Int(n) => Ok(n),
            _ => bad(format!("{what} is not an integer")),
        }
    }

    fn opt_int<T: TryFrom<i128>>(&mut self, what: &str) -> Result<Option<T>, DecodeError> {
        match self.head()? {
            Head::Nil => Ok(None),
            Head::Int(n) => T::try_from(n)
                .map(Some)
                .or_else(|_| bad(format!("{what} out of range"))),
            _ => bad(format!("{what} is not an integer")),
        }
    }

    fn uint<T: TryFrom<i128>>(&mut self, what: &str) -> Result<T, DecodeError> {
        T::try_from(self.int(what)?).or_else(|_| bad(format!("{what} out of range")))
    }

    fn opt_str(&mut self, what: &str) -> Result<Option<String>, DecodeError> {
        match self.head()? {
            Head::Nil => Ok(None),
            Head::Str(s) => utf8(s, what).map(Some),
            _ => bad(format!("{what} is not a string")),
        }
    }

    fn hash(&mut self) -> Result<Option<BlockHash>, DecodeError> {
        match self.head()? {
            Head::Nil => Ok(None),
            Head::Int(n) => Ok(Some(BlockHash::Int(n))),
            Head::Bin(b) | Head::Str(b) => Ok(Some(BlockHash::Bytes(b.into()))),
            _ => bad("a block hash is neither an integer nor bytes"),
        }
    }

    fn hashes(&mut self) -> Result<Vec<BlockHash>, DecodeError> {
        let n = self.array("block_hashes")?;
        let mut hashes = Vec::with_capacity(self.capacity(n));
        for _ in 0..n {
            match self.hash()? {
                Some(hash) => hashes.push(hash),
                None => return bad("a block hash is nil"),
            }
        }
        Ok(hashes)
    }

    fn token_ids(&mut self) -> Result<Vec<u32>, DecodeError> {
        let n = self.array("token_ids")?;
        self.tokens(n)
    }

    /// `n` token ids (the items of an array whose head was read).
    fn tokens(&mut self, n: u32) -> Result<Vec<u32>, DecodeError> {
        let mut tokens = Vec::with_capacity(self.capacity(n));
        for _ in 0..n {
            tokens.push(self.uint("a token id")?);
        }
        Ok(tokens)
    }

    /// A list of token ids, or nil (none).
    fn opt_token_ids(&mut self) -> Result<Vec<u32>, DecodeError> {
        match self.head()? {
            Head::Nil => Ok(Vec::new()),
            Head::Array(n) => self.tokens(n),
            _ => bad("lookahead_token_ids is not an array"),
        }
    }

    fn value(&mut self, depth: usize) -> Result<ExtraValue, DecodeError> {
        Ok(match self.head()? {
            Head::Nil => ExtraValue::Nil,
            Head::Bool(b) => ExtraValue::Bool(b),
            Head::Int(n) => ExtraValue::Int(n),
            Head::Str(s) => ExtraValue::Str(utf8(s, "an extra key")?),
            Head::Bin(b) => ExtraValue::Bytes(b.into()),
            Head::Array(n) => {
                if depth >= MAX_DEPTH {
                    return bad("nested too deep");
                }
                let mut items = Vec::with_capacity(self.capacity(n));
                for _ in 0..n {
                    items.push(self.value(depth + 1)?);
                }
                ExtraValue::List(items)
            }
            Head::Float(_) | Head::Map(_) | Head::Ext => {
                return bad("an extra key is not a string, integer, bytes or tuple")
            }
        })
    }

    fn extra_keys(&mut self) -> Result<Vec<Option<Vec<ExtraValue>>>, DecodeError> {
        let n = match self.head()? {
            Head::Nil => return Ok(Vec::new()),
            Head::Array(n) => n,
            _ => return bad("extra_keys is not an array"),
        };
        let mut keys = Vec::with_capacity(self.capacity(n));
        for _ in 0..n {
            keys.push(match self.value(1)? {
                ExtraValue::Nil => None,
                ExtraValue::List(values) => Some(values),
                _ => return bad("an entry of extra_keys is not a tuple"),
            });
        }
        Ok(keys)
    }

    fn event(&mut self) -> Result<KvEvent, DecodeError> {
        match self.head()? {
            Head::Map(n) => self.map_event(n),
            Head::Array(n) => self.array_event(n),
            _ => bad("an event is neither a map nor an array"),
        }
    }

    /// The 2026 form: `{"type": "BlockStored", "block_hashes": [...], ...}`.
    fn map_event(&mut self, n: u32) -> Result<KvEvent, DecodeError> {
        let (mut kind, mut stored, mut removed) =
            (None, BlockStored::default(), BlockRemoved::default());
        for _ in 0..n {
            let key = match self.head()? {
                Head::Str(key) => key,
                _ => return bad("an event's key is not a string"),
            };
            match key {
                b"type" => kind = self.opt_str("type")?,
                b"block_hashes" => {
                    stored.block_hashes = self.hashes()?;
                    removed.block_hashes = stored.block_hashes.clone();
                }
                b"parent_block_hash" => stored.parent_block_hash = self.hash()?,
                b"token_ids" => stored.token_ids = self.token_ids()?,
                b"block_size" => stored.block_size = self.uint("block_size")?,
                b"lora_id" => stored.lora_id = self.opt_int("lora_id")?,
                b"medium" => {
                    stored.medium = self.opt_str("medium")?;
                    removed.medium = stored.medium.clone();
                }
                b"lora_name" => stored.lora_name = self.opt_str("lora_name")?,
                b"extra_keys" => stored.extra_keys = self.extra_keys()?,
                b"group_idx" => {
                    stored.group_idx = self.opt_int("group_idx")?;
                    removed.group_idx = stored.group_idx;
                }
                b"kv_cache_spec_kind" => {
                    stored.kv_cache_spec_kind = self.opt_str("kv_cache_spec_kind")?
                }
                b"kv_cache_spec_sliding_window" => {
                    stored.kv_cache_spec_sliding_window =
                        self.opt_int("kv_cache_spec_sliding_window")?
                }
                b"locality" => {
                    stored.locality = self.opt_str("locality")?;
                    removed.locality = stored.locality.clone();
                }
                b"ownership" => {
                    stored.ownership = self.opt_str("ownership")?;
                    removed.ownership = stored.ownership.clone();
                }
                b"session_id" => stored.session_id = self.opt_str("session_id")?,
                b"lookahead_token_ids" => stored.lookahead_token_ids = self.opt_token_ids()?,
                _ => self.skip(1)?,
            }
        }
        Ok(match kind.as_deref() {
            Some("BlockStored") => KvEvent::BlockStored(stored),
            Some("BlockRemoved") => KvEvent::BlockRemoved(removed),
            Some("AllBlocksCleared") => KvEvent::AllBlocksCleared,
            Some(other) => KvEvent::Unknown(other.to_owned()),
            None => return bad("an event has no type"),
        })
    }

    /// The earlier form: `["BlockStored", block_hashes, parent, token_ids, block_size, lora_id,
    /// medium, lora_name, extra_keys, group_idx, ...]`, fields in their declaration order.
    fn array_event(&mut self, n: u32) -> Result<KvEvent, DecodeError> {
        if n == 0 {
            return bad("an event array is empty");
        }
        let kind = match self.head()? {
            Head::Str(kind) => utf8(kind, "type")?,
            _ => return bad("an event array does not begin with its type"),
        };
        let fields = n as usize - 1;
        let event = match kind.as_str() {
            "BlockStored" => {
                let mut stored = BlockStored::default();
                let mut read = 0;
                for field in 0..fields {
                    match field {
                        0 => stored.block_hashes = self.hashes()?,
                        1 => stored.parent_block_hash = self.hash()?,
                        2 => stored.token_ids = self.token_ids()?,
                        3 => stored.block_size = self.uint("block_size")?,
                        4 => stored.lora_id = self.opt_int("lora_id")?,
                        5 => stored.medium = self.opt_str("medium")?,
                        6 => stored.lora_name = self.opt_str("lora_name")?,
                        7 => stored.extra_keys = self.extra_keys()?,
                        8 => stored.group_idx = self.opt_int("group_idx")?,
                        9 => stored.kv_cache_spec_kind = self.opt_str("kv_cache_spec_kind")?,
                        10 => {
                            stored.kv_cache_spec_sliding_window =
                                self.opt_int("kv_cache_spec_sliding_window")?
                        }
                        11 => stored.locality = self.opt_str("locality")?,
                        12 => stored.ownership = self.opt_str("ownership")?,
                        13 => stored.session_id = self.opt_str("session_id")?,
                        _ => self.skip(1)?,
                    }
                    read += 1;
                }
                if read < 4 {
                    return bad("a BlockStored array lacks its first four fields");
                }
                KvEvent::BlockStored(stored)
            }
            "BlockRemoved" => {
                let mut removed = BlockRemoved::default();
                for field in 0..fields {
                    match field {
                        0 => removed.block_hashes = self.hashes()?,
                        1 => removed.medium = self.opt_str("medium")?,
                        2 => removed.group_idx = self.opt_int("group_idx")?,
                        3 => removed.locality = self.opt_str("locality")?,
                        4 => removed.ownership = self.opt_str("ownership")?,
                        _ => self.skip(1)?,
                    }
                }
                if fields == 0 {
                    return bad("a BlockRemoved array has no block_hashes");
                }
                KvEvent::BlockRemoved(removed)
            }
            other => {
                self.skip_items(fields, 1)?;
                match other {
                    "AllBlocksCleared" => KvEvent::AllBlocksCleared,
                    _ => KvEvent::Unknown(other.to_owned()),
                }
            }
        };
        Ok(event)
    }
}

fn utf8(bytes: &[u8], what: &str) -> Result<String, DecodeError> {
    std::str::from_utf8(bytes)
        .map(str::to_owned)
        .or_else(|_| bad(format!("{what} is not UTF-8")))
}

impl EventBatch {
    /// Decodes a payload (the third frame of a PUB message, or a replayed payload).
    pub fn decode(payload: &[u8]) -> Result<Self, DecodeError> {
        let mut reader = Reader {
            input: Bytes::new(payload),
        };
        let n = reader.array("the batch")?;
        if !(2..=3).contains(&n) {
            return bad(format!("the batch has {n} items, not 2 or 3"));
        }
        let ts = match reader.head()? {
            Head::Float(ts) => ts,
            Head::Int(ts) => ts as f64,
            _ => return bad("the batch's timestamp is not a number"),
        };
        let count = reader.array("the events")?;
        let mut events = Vec::with_capacity(reader.capacity(count));
        for _ in 0..count {
            events.push(reader.event()?);
        }
        let data_parallel_rank = match n {
            3 => reader.opt_int("data_parallel_rank")?,
            _ => None,
        };
        if !reader.input.remaining_slice().is_empty() {
            return bad("bytes after the batch");
        }
        Ok(EventBatch {
            ts,
            events,
            data_parallel_rank,
        })
    }
}
