//! P's KV memory: one UCX-allocated region cut into fixed-size blocks, leased to transfers.

use std::sync::{Arc, Mutex, MutexGuard};

use super::context::MemRegion;
use crate::TransferError;

/// A run of blocks: `(first block, block count)`.
pub type BlockRange = (u64, u64);

/// A region of `block_bytes`-sized blocks, each free or leased.
pub struct BlockPool {
    region: MemRegion,
    block_bytes: usize,
    /// One flag per block: true when free.
    free: Mutex<Vec<bool>>,
}

impl BlockPool {
    /// Cuts `region` into blocks of `block_bytes` (a trailing partial block is not used).
    pub fn new(region: MemRegion, block_bytes: usize) -> Arc<Self> {
        let blocks = region.len() / block_bytes.max(1);
        Arc::new(BlockPool {
            region,
            block_bytes: block_bytes.max(1),
            free: Mutex::new(vec![true; blocks]),
        })
    }

    fn free(&self) -> MutexGuard<'_, Vec<bool>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The region the blocks live in.
    pub fn region(&self) -> &MemRegion {
        &self.region
    }

    /// The block size.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// Bytes in free blocks.
    pub fn free_bytes(&self) -> usize {
        self.free().iter().filter(|&&free| free).count() * self.block_bytes
    }

    /// Leases enough blocks for `len` bytes (the fewest runs first-fit finds) and copies `data`
    /// into them.
    pub fn lease(self: &Arc<Self>, data: &[u8]) -> Result<Lease, TransferError> {
        let needed = data.len().div_ceil(self.block_bytes);
        let ranges = {
            let mut free = self.free();
            let available = free.iter().filter(|&&f| f).count();
            if available < needed {
                return Err(TransferError::PoolFull {
                    needed: data.len() as u64,
                    free: (available * self.block_bytes) as u64,
                });
            }
            let mut ranges: Vec<BlockRange> = Vec::new();
            let mut missing = needed;
            let mut block = 0;
            while missing > 0 {
                if free[block] {
                    free[block] = false;
                    missing -= 1;
                    match ranges.last_mut() {
                        Some((start, count)) if *start + *count == block as u64 => *count += 1,
                        _ => ranges.push((block as u64, 1)),
                    }
                }
                block += 1;
            }
            ranges
        };
        let lease = Lease {
            pool: self.clone(),
            ranges,
            len: data.len(),
        };
        let mut copied = 0;
        for &(start, count) in &lease.ranges {
            let bytes = (count as usize * self.block_bytes).min(data.len() - copied);
            let offset = start as usize * self.block_bytes;
            // SAFETY: these blocks were just marked leased to this lease alone.
            unsafe { self.region.write(offset, &data[copied..copied + bytes]) };
            copied += bytes;
        }
        Ok(lease)
    }
}

/// Blocks holding one transfer's KV; back in the pool on drop.
pub struct Lease {
    pool: Arc<BlockPool>,
    ranges: Vec<BlockRange>,
    len: usize,
}

impl Lease {
    /// The blocks, as runs.
    pub fn ranges(&self) -> &[BlockRange] {
        &self.ranges
    }

    /// The KV's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the KV is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut free = self.pool.free();
        for &(start, count) in &self.ranges {
            for block in start..start + count {
                free[block as usize] = true;
            }
        }
    }
}
