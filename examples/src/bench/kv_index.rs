//! The KV index (`pd_router::kv_index`), in process, on one thread: block events ingested per
//! second on the synthetic traffic of `pd_router::kv_index::workload` (1,000 engines, block size
//! 16, 16-block events continuing each engine's chain, removals 100 events behind, with and
//! without the shared prefix re-announced, and at a cap that evicts), the time to match a
//! 2,048-token prompt against 1,000 engines (caches warm and emptied), and the memory held per
//! million blocks. A block stored or removed counts as one block event.

use std::time::{Duration, Instant};

use pd_protocol::kv_events::KvEvent;

use super::output::Output;
use pd_router::kv_index::workload::{self, BLOCK};
use pd_router::kv_index::{EngineSlot, KvIndex, KvIndexConfig, RequestKey};

/// The suite's sizes.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Engines in the traffic and in the matched index.
    pub engines: u32,
    /// Rounds of traffic (one event per engine each).
    pub rounds: u32,
    /// Warm-cache matches timed per prompt.
    pub matches: u32,
}

impl Settings {
    /// 1,000 engines, 120 rounds, 20,000 matches.
    pub const DEFAULT: Settings = Settings {
        engines: 1000,
        rounds: 120,
        matches: 20_000,
    };
}

/// One traffic run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct IngestRow {
    /// The traffic and the cap.
    pub workload: String,
    /// Block events (blocks stored or removed) in the traffic.
    pub block_events: usize,
    /// Block events per second over the whole traffic into an empty index (its tables growing
    /// as it fills), the fastest of 3 runs.
    pub from_empty_per_s: f64,
    /// Block events per second over the traffic after the first removal (the index at its
    /// working size: as many blocks removed as stored), the fastest of the same 3 runs.
    pub working_size_per_s: f64,
    /// (engine, block) pairs held at the end.
    pub pairs: usize,
    /// Pairs evicted by the cap.
    pub evicted: usize,
    /// The index's memory (its own estimate) per million pairs held, MiB.
    pub mib_per_million: f64,
}

/// One prompt matched.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MatchRow {
    /// Which prompt.
    pub prompt: String,
    /// Engines holding its first block.
    pub engines_matched: usize,
    /// Mean over repeated matches (caches warm), µs.
    pub mean_us: f64,
    /// Median of 100 matches each after 128 MiB read (caches emptied), µs.
    pub cold_median_us: f64,
}

/// The traffic runs: (name, re-announced prefix, cap).
const TRAFFIC: [(&str, bool, usize); 3] = [
    ("chains", false, 4_000_000),
    ("chains, capped at 500,000 pairs", false, 500_000),
    ("chains + shared prefix re-announced", true, 4_000_000),
];

/// Ingests each traffic run three times into an empty index; the fastest of each.
pub fn ingest(settings: &Settings) -> Vec<IngestRow> {
    let mut rows = Vec::new();
    for (name, reuse, max_entries) in TRAFFIC {
        let events = workload::traffic(settings.engines, settings.rounds.into(), reuse);
        let block_events = workload::block_events(&events);
        let first_removal = (events.iter())
            .position(|(_, event)| matches!(event, KvEvent::BlockRemoved(_)))
            .unwrap_or(events.len());
        let (filling, working) = events.split_at(first_removal);
        let (mut whole, mut steady) = (Duration::MAX, Duration::MAX);
        let mut end = None;
        for _ in 0..3 {
            let mut index = KvIndex::new(KvIndexConfig {
                max_entries,
                ..KvIndexConfig::default()
            });
            let mut evicted = 0;
            let mut apply = |events: &[(EngineSlot, KvEvent)]| {
                let start = Instant::now();
                for (engine, event) in events {
                    evicted += index.apply(*engine, event).evicted;
                }
                start.elapsed()
            };
            let filled = apply(filling);
            let worked = apply(working);
            whole = whole.min(filled + worked);
            steady = steady.min(worked);
            end = Some((index.stats(), evicted));
        }
        let Some((stats, evicted)) = end else {
            continue;
        };
        let rate = |events: &[(EngineSlot, KvEvent)], time: Duration| {
            workload::block_events(events) as f64 / time.as_secs_f64()
        };
        let row = IngestRow {
            workload: format!("{name} ({} engines)", settings.engines),
            block_events,
            from_empty_per_s: rate(&events, whole),
            working_size_per_s: rate(working, steady),
            pairs: stats.blocks,
            evicted,
            mib_per_million: stats.bytes as f64 / stats.blocks.max(1) as f64 * 1e6
                / f64::from(1 << 20),
        };
        eprint!("{}", ingest_line(&row));
        rows.push(row);
    }
    rows
}

/// Matches a 2,048-token prompt against an index of `settings.engines` engines (1,900 blocks
/// of their own each besides their part of the prompt), and a prompt none holds.
pub fn matching(settings: &Settings) -> Vec<MatchRow> {
    const TOKENS: usize = 2048;
    let (index, shared) = workload::match_fixture(settings.engines, TOKENS, 1_900);
    let key = RequestKey::default();
    let run = |prompt: &[u32]| index.match_prefix(&key, prompt, BLOCK);
    let flush: Vec<u64> = (0..16u64 << 20).collect();
    let mut rows = Vec::new();
    for (name, prompt) in [
        ("2,048 tokens, shared", shared),
        ("2,048 tokens, unknown", workload::unknown_prompt(TOKENS)),
    ] {
        let engines_matched = run(&prompt).len();
        let start = Instant::now();
        for _ in 0..settings.matches {
            std::hint::black_box(run(std::hint::black_box(&prompt)));
        }
        let mean = start.elapsed() / settings.matches.max(1);
        let mut cold: Vec<Duration> = (0..100)
            .map(|_| {
                std::hint::black_box(flush.iter().sum::<u64>());
                let start = Instant::now();
                std::hint::black_box(run(std::hint::black_box(&prompt)));
                start.elapsed()
            })
            .collect();
        cold.sort();
        let row = MatchRow {
            prompt: format!("{name} ({} pairs held)", index.len()),
            engines_matched,
            mean_us: mean.as_secs_f64() * 1e6,
            cold_median_us: cold[cold.len() / 2].as_secs_f64() * 1e6,
        };
        eprint!("{}", match_line(&row));
        rows.push(row);
    }
    rows
}

fn ingest_line(r: &IngestRow) -> String {
    format!(
        "| {} | {} | {:.2} | {:.2} | {} | {} | {:.0} |\n",
        r.workload,
        r.block_events,
        r.from_empty_per_s / 1e6,
        r.working_size_per_s / 1e6,
        r.pairs,
        r.evicted,
        r.mib_per_million
    )
}

fn match_line(r: &MatchRow) -> String {
    format!(
        "| {} | {} | {:.2} | {:.2} |\n",
        r.prompt, r.engines_matched, r.mean_us, r.cold_median_us
    )
}

/// The suite's section: ingestion, then matching, each a table and its rows as JSON.
pub fn section(out: &mut Output, settings: &Settings) -> Result<(), String> {
    let rows = ingest(settings);
    out.section("kv-index-ingest", &ingest_table(&rows), &rows, vec![])?;
    out.text("\n");
    let rows = matching(settings);
    out.section("kv-index-match", &match_table(&rows), &rows, vec![])
}

/// The ingestion rows as a Markdown table.
pub fn ingest_table(rows: &[IngestRow]) -> String {
    let mut out = String::from(
        "| traffic | block events | M block events/s, from empty | at working size | pairs held | evicted | MiB per million pairs |\n\
         |---|---|---|---|---|---|---|\n",
    );
    rows.iter().for_each(|r| out.push_str(&ingest_line(r)));
    out
}

/// The matching rows as a Markdown table.
pub fn match_table(rows: &[MatchRow]) -> String {
    let mut out = String::from(
        "| prompt | engines matched | mean µs (caches warm) | median µs (caches emptied) |\n\
         |---|---|---|---|\n",
    );
    rows.iter().for_each(|r| out.push_str(&match_line(r)));
    out
}
