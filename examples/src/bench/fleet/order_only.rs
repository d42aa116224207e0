//! The order-only replay: a trace's requests placed one after another on engines whose prefix
//! caches are LRU sets of blocks, with no timing at all. Each routing rule is the one
//! `../shared/bench/traces/cache_sim.py` (the oracle) applies, step for step and with the same
//! random numbers, so that the hit rates this replay finds equal the oracle's: the trace is read
//! and its prefixes are shared as they should be, before any timed replay is trusted.

use std::num::NonZeroUsize;

use lru::LruCache;

use super::python_random::PythonRandom;
use super::trace::Trace;

/// How a request's engine is chosen (the oracle's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// Any engine, uniformly (Python's `random.Random(seed).randrange`).
    Random,
    /// Each engine in turn.
    RoundRobin,
    /// The engine that has computed the fewest prompt tokens so far.
    LeastLoad,
    /// The longest cached prefix; the least loaded of those that tie.
    PrefixGreedy,
    /// The longest cached prefix among the engines loaded at most `(1 + eps)` times the mean
    /// (plus one token); the least loaded of those that tie.
    PrefixBounded,
}

impl Rule {
    /// Every rule, in the oracle's order.
    pub const ALL: [Rule; 5] = [
        Rule::Random,
        Rule::RoundRobin,
        Rule::LeastLoad,
        Rule::PrefixGreedy,
        Rule::PrefixBounded,
    ];

    /// The rule's name, as the oracle spells it.
    pub fn name(self) -> &'static str {
        match self {
            Rule::Random => "random",
            Rule::RoundRobin => "round_robin",
            Rule::LeastLoad => "least_load",
            Rule::PrefixGreedy => "prefix_greedy",
            Rule::PrefixBounded => "prefix_bounded",
        }
    }
}

/// The engines of an order-only replay.
#[derive(Debug, Clone, Copy)]
pub struct Fleet {
    /// How many engines.
    pub engines: usize,
    /// Each engine's prefix cache, in tokens (whole blocks of it are used).
    pub cache_tokens: u64,
    /// The bounded-load rule's slack over the mean load.
    pub eps: f64,
    /// The random rule's seed.
    pub seed: u32,
}

/// What one rule made of one trace.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OrderOnlyRow {
    /// The trace's file name.
    pub trace: String,
    /// The rule.
    pub rule: Rule,
    /// Engines.
    pub engines: usize,
    /// Tokens of prefix cache per engine.
    pub cache_tokens: u64,
    /// Requests placed.
    pub requests: usize,
    /// Prompt tokens found in the chosen engine's cache, over all prompt tokens.
    pub hit_rate: f64,
    /// The most prompt tokens one engine computed, over the mean.
    pub imbalance: f64,
}

/// Places every request of `trace` on `fleet` by `rule`.
pub fn replay(trace: &Trace, fleet: Fleet, rule: Rule) -> OrderOnlyRow {
    let block = u64::from(trace.block_tokens);
    let capacity = NonZeroUsize::new((fleet.cache_tokens / block) as usize);
    let mut caches: Vec<Option<LruCache<u64, ()>>> = (0..fleet.engines)
        .map(|_| capacity.map(LruCache::new))
        .collect();
    let mut load = vec![0u64; fleet.engines];
    let mut random = PythonRandom::new(fleet.seed);
    let (mut hit, mut total) = (0u64, 0u64);
    for (nth, request) in trace.requests.iter().enumerate() {
        let blocks = &request.blocks;
        let matched: Vec<usize> = match rule {
            Rule::PrefixGreedy | Rule::PrefixBounded => {
                caches.iter().map(|c| prefix_blocks(c, blocks)).collect()
            }
            _ => Vec::new(),
        };
        let all: Vec<usize> = (0..fleet.engines).collect();
        let engine = match rule {
            Rule::Random => random.below(fleet.engines),
            Rule::RoundRobin => nth % fleet.engines,
            Rule::LeastLoad => least_loaded(&all, &load),
            Rule::PrefixGreedy => longest_then_least_loaded(&all, &matched, &load),
            Rule::PrefixBounded => {
                let mean = load.iter().sum::<u64>() as f64 / fleet.engines as f64;
                let bound = (1.0 + fleet.eps) * mean + 1.0;
                let light: Vec<usize> = (all.iter().copied())
                    .filter(|&j| load[j] as f64 <= bound)
                    .collect();
                let allowed = if light.is_empty() { &all } else { &light };
                longest_then_least_loaded(allowed, &matched, &load)
            }
        };
        let input = u64::from(request.input);
        let cached = (prefix_blocks(&caches[engine], blocks) as u64 * block).min(input);
        hit += cached;
        total += input;
        load[engine] += input - cached;
        if let Some(cache) = &mut caches[engine] {
            for &id in blocks {
                if cache.get(&id).is_none() {
                    cache.put(id, ());
                }
            }
        }
    }
    let mean = load.iter().sum::<u64>() as f64 / fleet.engines as f64;
    OrderOnlyRow {
        trace: trace.name.clone(),
        rule,
        engines: fleet.engines,
        cache_tokens: fleet.cache_tokens,
        requests: trace.requests.len(),
        hit_rate: hit as f64 / total.max(1) as f64,
        imbalance: load.iter().copied().max().unwrap_or(0) as f64 / mean.max(f64::MIN_POSITIVE),
    }
}

/// How many of `blocks`, from the first, `cache` holds (without touching them).
fn prefix_blocks(cache: &Option<LruCache<u64, ()>>, blocks: &[u64]) -> usize {
    let Some(cache) = cache else { return 0 };
    blocks.iter().take_while(|id| cache.contains(id)).count()
}

/// The first of `engines` with the least load.
fn least_loaded(engines: &[usize], load: &[u64]) -> usize {
    let least = engines.iter().map(|&j| load[j]).min().unwrap_or(0);
    (engines.iter().copied())
        .find(|&j| load[j] == least)
        .unwrap_or(0)
}

/// Among `engines`, those with the most matched blocks, and of those the first least loaded.
fn longest_then_least_loaded(engines: &[usize], matched: &[usize], load: &[u64]) -> usize {
    let best = engines.iter().map(|&j| matched[j]).max().unwrap_or(0);
    let longest: Vec<usize> = (engines.iter().copied())
        .filter(|&j| matched[j] == best)
        .collect();
    least_loaded(&longest, load)
}
