//! Precise prefix: route on what the engines say they hold (their KV cache events, followed
//! into the proxy's index), not on a guess from where prompts were sent.
//!
//! For each usable candidate `c`, with `prompt` the prompt's tokens and `cached(c)` its leading
//! tokens `c` holds (whole blocks, from the index):
//!
//! ```text
//! cost(c)   = (prompt - cached(c)) + kv_load_weight * queued(c)
//! queued(c) = pending(c) + max(0, load(c) - pending_requests(c)) * typical
//! ```
//!
//! `queued(c)` estimates the work waiting on `c`, in tokens: `pending(c)` is the uncached
//! tokens of the requests this policy sent `c` that have not begun answering
//! ([`QueuedWork`]), and the rest of its load (requests this policy did not place, or that are
//! past their prompt) counts `typical` each, the mean uncached tokens of this policy's recent
//! picks. A holder busy with cheap hits thus stays cheap. The cheapest wins; among equals, the
//! one holding more, then each in turn. A prompt nobody holds goes where cache_aware remembers
//! its prefix went before (within cache_aware's load balance): a prefix evicted everywhere
//! comes back to its home instead of wandering, so each engine keeps a stable share of the
//! prefixes. For a prefill the first term is the prompt it must compute; for a decode, the KV
//! it must pull. When the prompt's tokens are
//! unknown (`no_tokens`) or no candidate's events are followed (`no_events`), the request is
//! placed by cache_aware instead. Every pick is counted by reason
//! (`pd_proxy_route_picks_total`) and noted for `x-pd-route`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use prometheus::IntCounter;

use super::queued_work::{Pending, QueuedWork};
use super::{CacheAware, Candidates, Policy, RequestInfo};
use crate::kv_events::{Held, KvTracker};

/// Why a candidate was picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickReason {
    /// It holds part of the prompt and was the cheapest.
    KvHit,
    /// No usable candidate holds any of the prompt: the least loaded.
    KvMiss,
    /// The prompt's tokens are unknown: cache_aware placed it.
    NoTokens,
    /// No usable candidate's events are followed: cache_aware placed it.
    NoEvents,
}

impl PickReason {
    /// Every reason, in the order of [`PickReason::slot`].
    pub const ALL: [PickReason; 4] = [
        PickReason::KvHit,
        PickReason::KvMiss,
        PickReason::NoTokens,
        PickReason::NoEvents,
    ];

    /// The `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            PickReason::KvHit => "kv_hit",
            PickReason::KvMiss => "kv_miss",
            PickReason::NoTokens => "no_tokens",
            PickReason::NoEvents => "no_events",
        }
    }

    fn slot(self) -> usize {
        self as usize
    }
}

/// A pick made by this policy, noted on the request (which holds its share of the chosen
/// candidate's queued work until it ends).
#[derive(Debug)]
pub struct PickNote {
    /// Why.
    pub reason: PickReason,
    /// The prompt's leading tokens the chosen engine holds.
    pub cached_tokens: usize,
    /// The request's share of the chosen candidate's queued work, until the request ends or
    /// the flow takes it to tie it to P's call.
    pub pending: Mutex<Option<Pending>>,
}

/// Which choice a policy instance makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// The (prefill, dp rank) pair.
    Prefill,
    /// The decode.
    Decode,
}

/// The precise-prefix policy; see the module documentation.
pub struct PrecisePrefix {
    tracker: Arc<KvTracker>,
    choice: Choice,
    load_weight: f64,
    fallback: CacheAware,
    /// The mean uncached tokens of recent picks, as `f64` bits.
    typical: AtomicU64,
    queued: QueuedWork,
    turn: AtomicUsize,
    picks: [IntCounter; 4],
}

impl PrecisePrefix {
    /// The policy for `choice`, reading `tracker`'s index, with `fallback` for requests it
    /// cannot place.
    pub fn new(
        tracker: Arc<KvTracker>,
        choice: Choice,
        load_weight: f64,
        fallback: CacheAware,
    ) -> Self {
        let label = match choice {
            Choice::Prefill => "prefill",
            Choice::Decode => "decode",
        };
        let picks = PickReason::ALL.map(|r| tracker.pick_counter(label, r.as_str()));
        PrecisePrefix {
            tracker,
            choice,
            load_weight,
            fallback,
            typical: AtomicU64::new(0),
            queued: QueuedWork::default(),
            turn: AtomicUsize::new(0),
            picks,
        }
    }

    fn note(
        &self,
        request: &RequestInfo<'_>,
        reason: PickReason,
        cached_tokens: usize,
        pending: Option<Pending>,
    ) {
        self.picks[reason.slot()].inc();
        let _ = request.notes[self.choice as usize].set(PickNote {
            reason,
            cached_tokens,
            pending: Mutex::new(pending),
        });
    }

    /// The engines' holdings for `request`, when its tokens are known.
    fn held<'r>(&self, request: &'r RequestInfo<'_>) -> Option<(&'r [Held], usize)> {
        let tokens = request.tokens()?;
        let held = request.held(|| self.tracker.holders(&request.kv_key(), tokens));
        Some((held, tokens.len()))
    }

    /// `cached(c)` of every usable candidate, or `None` when none of them is followed.
    fn cached(
        candidates: &dyn Candidates,
        held: &[Held],
        usable: &[usize],
        prompt: usize,
    ) -> Option<Vec<usize>> {
        let mut known = false;
        let cached = usable
            .iter()
            .map(|&i| {
                let id = candidates.id(i);
                let mine = held.iter().filter(|h| h.owner == id);
                mine.map(|h| {
                    known = true;
                    h.cached_tokens.min(prompt)
                })
                .max()
                .unwrap_or(0)
            })
            .collect();
        known.then_some(cached)
    }

    fn typical(&self, prompt: usize) -> f64 {
        match f64::from_bits(self.typical.load(Ordering::Relaxed)) {
            t if t > 0.0 => t,
            _ => prompt as f64,
        }
    }

    /// Folds `uncached` into the running mean (a weight of 1/64 per pick).
    fn learn(&self, prompt: usize, uncached: usize) {
        let typical = self.typical(prompt);
        let next = typical + (uncached as f64 - typical) / 64.0;
        self.typical
            .store(next.max(1.0).to_bits(), Ordering::Relaxed);
    }
}

impl Policy for PrecisePrefix {
    fn pick(&self, candidates: &dyn Candidates, request: &RequestInfo<'_>) -> Option<usize> {
        let usable: Vec<usize> = (0..candidates.len())
            .filter(|&i| candidates.usable(i))
            .collect();
        if usable.is_empty() {
            return None;
        }
        let fallback = |reason| {
            self.note(request, reason, 0, None);
            self.fallback.pick(candidates, request)
        };
        let Some((held, prompt)) = self.held(request) else {
            return fallback(PickReason::NoTokens);
        };
        let Some(cached) = Self::cached(candidates, held, &usable, prompt) else {
            return fallback(PickReason::NoEvents);
        };
        if cached.iter().all(|&c| c == 0) {
            // Nobody holds it: where cache_aware remembers the prefix went before (its home,
            // even if evicted since), within cache_aware's load balance.
            let index = self.fallback.pick(candidates, request)?;
            let pending = self.queued.add(candidates.id(index), prompt as u64);
            self.note(request, PickReason::KvMiss, 0, Some(pending));
            self.learn(prompt, prompt);
            return Some(index);
        }
        let typical = self.typical(prompt);
        let cost = |k: usize| {
            let work = self.queued.of(candidates.id(usable[k]));
            let others = (candidates.load(usable[k]) as u64).saturating_sub(work.requests());
            let queued = work.tokens() as f64 + others as f64 * typical;
            (prompt - cached[k]) as f64 + self.load_weight * queued
        };
        let costs: Vec<f64> = (0..usable.len()).map(cost).collect();
        let least = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let cheapest: Vec<usize> = (0..usable.len()).filter(|&k| costs[k] <= least).collect();
        let most = cheapest.iter().map(|&k| cached[k]).max().unwrap_or(0);
        let tied: Vec<usize> = cheapest
            .into_iter()
            .filter(|&k| cached[k] == most)
            .collect();
        let k = tied[self.turn.fetch_add(1, Ordering::Relaxed) % tied.len()];
        let reason = match cached[k] {
            0 => PickReason::KvMiss,
            _ => PickReason::KvHit,
        };
        let uncached = prompt - cached[k];
        let pending = self.queued.add(candidates.id(usable[k]), uncached as u64);
        self.note(request, reason, cached[k], Some(pending));
        self.learn(prompt, uncached);
        Some(usable[k])
    }

    fn prefix_match(&self, candidates: &dyn Candidates, request: &RequestInfo<'_>) -> Option<f64> {
        let usable: Vec<usize> = (0..candidates.len())
            .filter(|&i| candidates.usable(i))
            .collect();
        let (held, prompt) = self.held(request)?;
        let cached = Self::cached(candidates, held, &usable, prompt)?;
        let best = cached.into_iter().max()?;
        Some(if prompt == 0 {
            0.0
        } else {
            best as f64 / prompt as f64
        })
    }
}
