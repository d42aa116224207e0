//! The proxy's own block keys, and the engines' hashes folded to 64 bits.
//!
//! `key(i) = mix(key(i - 1) or ROOT, hash(tokens of block i), material(i))`, where `material`
//! covers what the engine mixes into a block's hash besides its tokens, as far as its events
//! show it: the LoRA name and the block's `extra_keys` entry (see the parent module for the
//! exact rule). Every function here is fixed: no per-process seed, no platform dependence
//! (integers are mixed as integers, bytes read little-endian), so every replica of the proxy
//! computes the same keys. The mix is a folded 64x64->128 multiply (wyhash's), fast and well
//! spread, not collision resistant against a chosen prompt: a collision only misplaces a
//! request, the engines key their caches themselves.

use pd_protocol::kv_events::{BlockHash, ExtraValue};

/// Mixing constants (wyhash's secret).
const K: [u64; 4] = [
    0xa076_1d64_78bd_642f,
    0xe703_7ed1_a0b4_28db,
    0x8ebc_6af0_9c88_c6e3,
    0x5899_65cc_7537_4cc3,
];

/// The parent key of a prompt's first block.
pub(super) const ROOT: u64 = 0x7064_2d70_726f_7879;

/// The material of a block with no LoRA and no extra keys.
pub(super) const NO_MATERIAL: u64 = 0;

// Type tags, so that values of different kinds never hash alike.
const TAG_NIL: u64 = 1;
const TAG_BOOL: u64 = 2;
const TAG_INT: u64 = 3;
const TAG_STR: u64 = 4;
const TAG_BYTES: u64 = 5;
const TAG_LIST: u64 = 6;
const TAG_LORA_NAME: u64 = 7;
const TAG_LORA_ID: u64 = 8;
const TAG_ENTRY: u64 = 9;

#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

#[inline(always)]
fn pair(lo: u32, hi: u32) -> u64 {
    u64::from(lo) | (u64::from(hi) << 32)
}

/// The hash of one block's token ids (their number included). Two independent lanes of four
/// tokens each, so a long prompt hashes at about a token per cycle.
#[inline]
fn tokens_hash(tokens: &[u32]) -> u64 {
    let (mut a, mut b) = (K[0], K[1]);
    let mut chunks = tokens.chunks_exact(8);
    for c in &mut chunks {
        a = fold(pair(c[0], c[1]) ^ K[2], pair(c[2], c[3]) ^ a);
        b = fold(pair(c[4], c[5]) ^ K[3], pair(c[6], c[7]) ^ b);
    }
    for &t in chunks.remainder() {
        a = fold(u64::from(t) ^ K[2], a ^ K[3]);
    }
    fold(a ^ tokens.len() as u64, b ^ K[0])
}

/// The key of a block: its parent's key (or [`ROOT`]), its token ids, its material.
#[inline]
pub(super) fn block_key(parent: u64, tokens: &[u32], material: u64) -> u64 {
    let h = fold(parent ^ K[0], tokens_hash(tokens) ^ K[1]);
    fold(h ^ K[2], material ^ K[3])
}

/// An engine's block hash in 64 bits: an integer truncated to its low 64 bits (vLLM's integer
/// hashes are 64-bit already), bytes hashed.
pub(super) fn engine_hash(hash: &BlockHash) -> u64 {
    match hash {
        BlockHash::Int(i) => *i as u64,
        BlockHash::Bytes(b) => {
            let mut m = Material::new();
            m.bytes(TAG_BYTES, b);
            m.0
        }
    }
}

/// A streaming hash of key material.
#[derive(Clone, Copy)]
struct Material(u64);

impl Material {
    fn new() -> Self {
        Material(K[1])
    }

    fn word(&mut self, x: u64) {
        self.0 = fold(self.0 ^ K[2], x ^ K[3]);
    }

    fn bytes(&mut self, tag: u64, bytes: &[u8]) {
        self.word(tag);
        self.word(bytes.len() as u64);
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.word(u64::from_le_bytes(w));
        }
    }

    fn value(&mut self, value: &ExtraValue) {
        match value {
            ExtraValue::Nil => self.word(TAG_NIL),
            ExtraValue::Bool(b) => {
                self.word(TAG_BOOL);
                self.word(u64::from(*b));
            }
            ExtraValue::Int(i) => {
                self.word(TAG_INT);
                self.word(*i as u64);
                self.word((*i >> 64) as u64);
            }
            ExtraValue::Str(s) => self.bytes(TAG_STR, s.as_bytes()),
            ExtraValue::Bytes(b) => self.bytes(TAG_BYTES, b),
            ExtraValue::List(values) => {
                self.word(TAG_LIST);
                self.word(values.len() as u64);
                values.iter().for_each(|v| self.value(v));
            }
        }
    }
}

/// The LoRA part of the material of every block of one event (or one request).
#[derive(Clone, Copy)]
pub(super) struct Lora(Option<Material>);

impl Lora {
    /// From a `BlockStored`: its `lora_name`, else its deprecated `lora_id` (which no request
    /// can name, so such blocks match no request rather than a base-model one).
    pub(super) fn of_event(lora_name: Option<&str>, lora_id: Option<i64>) -> Self {
        match (lora_name, lora_id) {
            (Some(name), _) => Self::named(Some(name)),
            (None, Some(id)) => {
                let mut m = Material::new();
                m.word(TAG_LORA_ID);
                m.word(id as u64);
                Lora(Some(m))
            }
            (None, None) => Lora(None),
        }
    }

    /// From a request's adapter name.
    pub(super) fn named(lora_name: Option<&str>) -> Self {
        Lora(lora_name.map(|name| {
            let mut m = Material::new();
            m.bytes(TAG_LORA_NAME, name.as_bytes());
            m
        }))
    }

    /// A block's material from an event's `extra_keys` entry (`None` or empty: no entry).
    pub(super) fn with_entry(self, entry: Option<&[ExtraValue]>) -> u64 {
        let entry = entry.filter(|values| !values.is_empty());
        if self.0.is_none() && entry.is_none() {
            return NO_MATERIAL;
        }
        let mut m = self.0.unwrap_or_else(Material::new);
        if let Some(values) = entry {
            m.word(TAG_ENTRY);
            m.word(values.len() as u64);
            values.iter().for_each(|v| m.value(v));
        }
        m.0
    }

    /// A block's material from an entry of strings, hashed exactly as the same entry of
    /// [`ExtraValue::Str`] values is by [`Lora::with_entry`].
    pub(super) fn with_str_entry(self, entry: &[&str]) -> u64 {
        if self.0.is_none() && entry.is_empty() {
            return NO_MATERIAL;
        }
        let mut m = self.0.unwrap_or_else(Material::new);
        if !entry.is_empty() {
            m.word(TAG_ENTRY);
            m.word(entry.len() as u64);
            entry.iter().for_each(|s| m.bytes(TAG_STR, s.as_bytes()));
        }
        m.0
    }
}

/// The materials of a text-only request's blocks, as vLLM publishes them: the first block's
/// entry is `(lora_name, cache_salt)` (each only when set; an empty salt is no salt, as vLLM
/// tests its truthiness), every later block's `(lora_name,)`.
pub(super) fn request_materials(lora_name: Option<&str>, cache_salt: Option<&str>) -> [u64; 2] {
    let lora = Lora::named(lora_name);
    let salt = cache_salt.filter(|s| !s.is_empty());
    let mut first = [""; 2];
    let mut n = 0;
    for value in lora_name.into_iter().chain(salt) {
        first[n] = value;
        n += 1;
    }
    let rest = &first[..usize::from(lora_name.is_some())];
    [lora.with_str_entry(&first[..n]), lora.with_str_entry(rest)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> ExtraValue {
        ExtraValue::Str(v.to_owned())
    }

    #[test]
    fn str_entries_hash_like_decoded_ones() {
        let lora = Lora::named(Some("ad"));
        let decoded = [s("ad"), s("salt")];
        assert_eq!(
            lora.with_entry(Some(&decoded)),
            lora.with_str_entry(&["ad", "salt"])
        );
        assert_eq!(Lora(None).with_entry(Some(&[])), NO_MATERIAL);
        assert_eq!(Lora(None).with_entry(None), NO_MATERIAL);
        assert_ne!(lora.with_entry(None), lora.with_str_entry(&["ad"]));
    }

    #[test]
    fn kinds_and_boundaries_are_distinguished() {
        let str_ = Lora(None).with_entry(Some(&[s("ab")]));
        let bytes = Lora(None).with_entry(Some(&[ExtraValue::Bytes(Box::from(&b"ab"[..]))]));
        let split = Lora(None).with_entry(Some(&[s("a"), s("b")]));
        let nested = Lora(None).with_entry(Some(&[ExtraValue::List(vec![s("a"), s("b")])]));
        let all = [str_, bytes, split, nested];
        for (i, a) in all.iter().enumerate() {
            assert!(all[i + 1..].iter().all(|b| a != b));
        }
    }

    #[test]
    fn token_hash_covers_every_token_and_the_length() {
        let base: Vec<u32> = (0..37).collect();
        let h = tokens_hash(&base);
        for i in 0..base.len() {
            let mut t = base.clone();
            t[i] += 1;
            assert_ne!(tokens_hash(&t), h, "token {i}");
        }
        assert_ne!(tokens_hash(&base[..36]), h);
        let mut zero_padded = base[..36].to_vec();
        zero_padded.push(0);
        assert_ne!(tokens_hash(&zero_padded), tokens_hash(&base[..36]));
    }

    #[test]
    fn keys_are_fixed_across_builds() {
        // The values every replica must compute: a change here changes every key.
        assert_eq!(
            block_key(ROOT, &[1, 2, 3], NO_MATERIAL),
            0xd037_bb6c_fd13_4d3d
        );
        let [first, rest] = request_materials(Some("ad"), Some("s"));
        assert_eq!(
            (first, rest),
            (0xc261_e49c_34a7_e4f7, 0xb40c_f2f7_230f_1717)
        );
        assert_eq!(engine_hash(&BlockHash::Int(-1)), u64::MAX);
    }
}
