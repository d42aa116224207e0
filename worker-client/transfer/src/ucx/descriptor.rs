//! What P's listener answers a UCX pull with: everything D needs to read the KV itself.
//!
//! JSON, e.g. `{"worker_address": "<hex>", "rkey": "<hex>", "base": 140230..., "region_len":
//! 268435456, "block_bytes": 65536, "ranges": [[0, 1024]], "len": 67108864}`: the KV is the
//! concatenation of the block runs `ranges` (first block, count) of the region at `base`,
//! truncated to `len` bytes.

use serde::{Deserialize, Serialize};

use super::pool::BlockRange;

/// The descriptor of one published transfer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvDescriptor {
    /// P's UCX worker address, hex.
    pub worker_address: String,
    /// The region's packed remote key, hex.
    pub rkey: String,
    /// The region's address in P.
    pub base: u64,
    /// The region's length.
    pub region_len: u64,
    /// The block size.
    pub block_bytes: u64,
    /// The transfer's blocks, as runs of (first block, count), in KV order.
    pub ranges: Vec<BlockRange>,
    /// The KV's length in bytes.
    pub len: u64,
}

/// One get of a pull: `len` bytes from P's `remote` address into the local buffer at `local`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Offset in D's buffer.
    pub local: usize,
    /// Address in P.
    pub remote: u64,
    /// Bytes.
    pub len: usize,
}

/// The largest KV a descriptor may describe (1 TiB); the puller's own limit is lower.
const MAX_LEN: u64 = 1 << 40;

/// The largest KV region a descriptor may announce (256 GiB, more than any P's pool here). D
/// maps and prefaults the region a descriptor names, so it is bounded too; beyond that, D trusts
/// the P workers the bootstrap server lists (see docs/transfer.md).
const MAX_REGION: u64 = 256 << 30;

impl KvDescriptor {
    /// Splits the transfer into gets of at most `chunk_bytes` that exactly tile `0..len` of
    /// D's buffer, after checking every range lies inside the region.
    pub fn chunks(&self, chunk_bytes: usize) -> Result<Vec<Chunk>, String> {
        if self.len > MAX_LEN {
            return Err(format!("len {} exceeds {MAX_LEN}", self.len));
        }
        if self.region_len > MAX_REGION {
            return Err(format!(
                "region_len {} exceeds {MAX_REGION}",
                self.region_len
            ));
        }
        if self.block_bytes == 0 || chunk_bytes == 0 {
            return Err("zero block or chunk size".into());
        }
        let region_end = self
            .base
            .checked_add(self.region_len)
            .ok_or("the region wraps around the address space")?;
        let mut chunks = Vec::new();
        let mut local: u64 = 0;
        for &(start, count) in &self.ranges {
            if local >= self.len {
                return Err("more blocks than len needs".into());
            }
            let offset = start.checked_mul(self.block_bytes);
            let bytes = count.checked_mul(self.block_bytes);
            let (Some(offset), Some(bytes)) = (offset, bytes) else {
                return Err(format!("range ({start}, {count}) overflows"));
            };
            let range_end = self
                .base
                .checked_add(offset)
                .and_then(|range_start| range_start.checked_add(bytes));
            if count == 0 || range_end.is_none_or(|end| end > region_end) {
                return Err(format!("range ({start}, {count}) is outside the region"));
            }
            let range_start = self.base + offset;
            let bytes = bytes.min(self.len - local);
            let mut done = 0;
            while done < bytes {
                let len = (bytes - done).min(chunk_bytes as u64);
                chunks.push(Chunk {
                    local: (local + done) as usize,
                    remote: range_start + done,
                    len: len as usize,
                });
                done += len;
            }
            local += bytes;
        }
        if local != self.len {
            return Err(format!("the ranges hold {local} of {} bytes", self.len));
        }
        Ok(chunks)
    }
}

/// Lowercase hex of `bytes`.
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of lowercase or uppercase hex `text`.
pub fn from_hex(text: &str) -> Result<Vec<u8>, String> {
    if !text.len().is_multiple_of(2) {
        return Err("odd-length hex".into());
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            text.get(i..i + 2)
                .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                .ok_or_else(|| format!("not hex at {i}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn descriptor(ranges: Vec<BlockRange>, len: u64) -> KvDescriptor {
        KvDescriptor {
            worker_address: String::new(),
            rkey: String::new(),
            base: 1 << 20,
            region_len: 16 * 100,
            block_bytes: 100,
            ranges,
            len,
        }
    }

    #[test]
    fn hostile_regions_and_ranges_are_refused() {
        // A region that ends exactly at the top of the address space, and a range far beyond
        // it: saturating arithmetic would have let it through.
        let mut top = descriptor(vec![(u64::MAX / 200, 1)], 100);
        top.base = u64::MAX - top.region_len;
        assert!(top.chunks(64).is_err());
        // A region larger than any pool: D would map and prefault it.
        let mut huge = descriptor(vec![(0, 1)], 100);
        huge.region_len = MAX_REGION + 1;
        assert!(huge.chunks(64).unwrap_err().contains("region_len"));
        // Within bounds, the same shapes are fine.
        assert!(descriptor(vec![(15, 1)], 100).chunks(64).is_ok());
        assert!(descriptor(vec![(16, 1)], 100).chunks(64).is_err());
    }

    #[test]
    fn chunks_tile_the_kv_across_ranges() {
        let chunks = descriptor(vec![(0, 2), (5, 1)], 250).chunks(64).unwrap();
        let tiled: usize = chunks.iter().map(|c| c.len).sum();
        assert_eq!(tiled, 250);
        assert_eq!(
            chunks[0],
            Chunk {
                local: 0,
                remote: 1 << 20,
                len: 64
            }
        );
        // The second range starts at block 5 and holds the last 50 bytes.
        let last = chunks.last().unwrap();
        assert_eq!(
            (last.local, last.remote, last.len),
            (200, (1 << 20) + 500, 50)
        );
        for pair in chunks.windows(2) {
            assert_eq!(
                pair[0].local + pair[0].len,
                pair[1].local,
                "contiguous locally"
            );
        }
    }

    #[test]
    fn inconsistent_descriptors_are_refused() {
        for (ranges, len) in [
            (vec![(0, 1)], 250),         // too few blocks
            (vec![(0, 2), (4, 1)], 150), // a block more than len needs
            (vec![(15, 2)], 150),        // past the region's end
            (vec![(u64::MAX, 1)], 10),   // overflow
            (vec![(0, 0)], 0),           // an empty run
        ] {
            assert!(
                descriptor(ranges.clone(), len).chunks(64).is_err(),
                "{ranges:?}"
            );
        }
        assert!(descriptor(vec![], 0).chunks(64).unwrap().is_empty());
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let bytes = vec![0u8, 1, 0xab, 0xff];
        assert_eq!(to_hex(&bytes), "0001abff");
        assert_eq!(from_hex("0001ABff").unwrap(), bytes);
        assert!(from_hex("abc").is_err());
        assert!(from_hex("zz").is_err());
    }
}
