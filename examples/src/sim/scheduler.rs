//! The engine's scheduler as vLLM's and SGLang's behave under load, simplified: a request
//! generates only inside the running batch, at most `--max-num-seqs` requests at once (vLLM's
//! flag; SGLang's `--max-running-requests`), the others waiting their turn, first come first
//! served; it also holds the KV blocks of its prompt and its answer (`--kv-cache-blocks` of 16
//! tokens) from admission to its end, so a full cache makes requests wait too; and each token
//! takes longer as the batch grows (`--decode-ms-per-token` × (1 + `--batch-slowdown` × the
//! other requests running)). Without limits every request is admitted at once, as before.
//!
//! What it reports is what vLLM's and SGLang's `/metrics` report: requests running and waiting,
//! and the share of the KV cache in use.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Tokens per KV block, as the sims count them everywhere.
pub const BLOCK_TOKENS: usize = 16;

/// The running batch and the KV cache of one engine.
pub struct Scheduler {
    /// A permit per request in the running batch (none: no limit).
    seqs: Option<Arc<Semaphore>>,
    /// A permit per KV block (none: no limit).
    blocks: Option<Arc<Semaphore>>,
    /// The KV blocks in all.
    capacity: usize,
    /// How much each other request running slows a token.
    slowdown: f64,
    running: Arc<AtomicUsize>,
    waiting: AtomicUsize,
    blocks_used: Arc<AtomicUsize>,
}

/// A request's place in the running batch and its KV blocks, given back when dropped (its
/// answer ended, or its client went away).
pub struct Admitted {
    _seq: Option<OwnedSemaphorePermit>,
    _blocks: Option<OwnedSemaphorePermit>,
    blocks: usize,
    running: Arc<AtomicUsize>,
    blocks_used: Arc<AtomicUsize>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.running.fetch_sub(1, Ordering::Relaxed);
        self.blocks_used.fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

/// A request no engine of this size can ever run: it needs more KV blocks than there are.
#[derive(Debug, thiserror::Error)]
#[error("the prompt and max_tokens need {needed} KV blocks of {BLOCK_TOKENS} tokens; the engine has {capacity}")]
pub struct TooLong {
    /// Blocks needed.
    pub needed: usize,
    /// Blocks in all.
    pub capacity: usize,
}

impl Scheduler {
    /// A scheduler of `max_seqs` requests at once and `kv_blocks` blocks (0: no limit), each
    /// token slowed by `slowdown` per other request running.
    pub fn new(max_seqs: usize, kv_blocks: usize, slowdown: f64) -> Self {
        let limit = |n: usize| (n > 0).then(|| Arc::new(Semaphore::new(n)));
        Scheduler {
            seqs: limit(max_seqs),
            blocks: limit(kv_blocks),
            capacity: kv_blocks,
            slowdown: slowdown.max(0.0),
            running: Arc::default(),
            waiting: AtomicUsize::new(0),
            blocks_used: Arc::default(),
        }
    }

    /// The KV blocks of `tokens` tokens.
    pub fn blocks_for(tokens: usize) -> usize {
        tokens.div_ceil(BLOCK_TOKENS)
    }

    /// Waits for a place in the running batch and `blocks` KV blocks (first come first
    /// served), or refuses a request that needs more blocks than the cache holds.
    pub async fn admit(&self, blocks: usize) -> Result<Admitted, TooLong> {
        if self.blocks.is_some() && blocks > self.capacity {
            return Err(TooLong {
                needed: blocks,
                capacity: self.capacity,
            });
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let seq = match &self.seqs {
            Some(seqs) => seqs.clone().acquire_owned().await.ok(),
            None => None,
        };
        let held = match &self.blocks {
            Some(pool) => {
                let n = u32::try_from(blocks).unwrap_or(u32::MAX);
                pool.clone().acquire_many_owned(n).await.ok()
            }
            None => None,
        };
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        self.running.fetch_add(1, Ordering::Relaxed);
        self.blocks_used.fetch_add(blocks, Ordering::Relaxed);
        Ok(Admitted {
            _seq: seq,
            _blocks: held,
            blocks,
            running: self.running.clone(),
            blocks_used: self.blocks_used.clone(),
        })
    }

    /// Requests in the running batch.
    pub fn running(&self) -> usize {
        self.running.load(Ordering::Relaxed)
    }

    /// Requests waiting to enter it.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// The share of the KV cache held (0 to 1; 0 without a limit).
    pub fn kv_usage(&self) -> f64 {
        match self.capacity {
            0 => 0.0,
            capacity => self.blocks_used.load(Ordering::Relaxed) as f64 / capacity as f64,
        }
    }

    /// The time of one token, `base` slowed by the other requests running now.
    pub fn per_token(&self, base: Duration) -> Duration {
        let others = self.running().saturating_sub(1) as f64;
        base.mul_f64(1.0 + self.slowdown * others)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn past_the_batch_requests_wait_in_turn() {
        let scheduler = Scheduler::new(2, 0, 0.0);
        let first = scheduler.admit(1).await.unwrap();
        let _second = scheduler.admit(1).await.unwrap();
        assert_eq!((scheduler.running(), scheduler.waiting()), (2, 0));
        let third = scheduler.admit(1);
        tokio::pin!(third);
        assert!(tokio::time::timeout(Duration::from_millis(50), &mut third)
            .await
            .is_err());
        assert_eq!(scheduler.waiting(), 1);
        drop(first);
        let _third = third.await.unwrap();
        assert_eq!((scheduler.running(), scheduler.waiting()), (2, 0));
    }

    #[tokio::test]
    async fn a_full_cache_makes_requests_wait_and_a_too_long_one_is_refused() {
        let scheduler = Scheduler::new(0, 10, 0.0);
        let big = scheduler.admit(8).await.unwrap();
        assert_eq!(scheduler.kv_usage(), 0.8);
        let next = scheduler.admit(4);
        tokio::pin!(next);
        assert!(tokio::time::timeout(Duration::from_millis(50), &mut next)
            .await
            .is_err());
        drop(big);
        let _next = next.await.unwrap();
        assert_eq!(scheduler.kv_usage(), 0.4);
        assert!(scheduler.admit(11).await.is_err());
    }

    #[tokio::test]
    async fn tokens_slow_down_as_the_batch_grows() {
        let scheduler = Scheduler::new(0, 0, 0.5);
        let base = Duration::from_millis(10);
        let _one = scheduler.admit(1).await.unwrap();
        assert_eq!(scheduler.per_token(base), base);
        let _two = scheduler.admit(1).await.unwrap();
        let _three = scheduler.admit(1).await.unwrap();
        assert_eq!(scheduler.per_token(base), Duration::from_millis(20));
        assert_eq!(Scheduler::blocks_for(33), 3);
    }
}
