//! pd-bench's suites: one subcommand each, with the flags that size it.

use std::path::PathBuf;
use std::time::Duration;

use clap::Subcommand;

/// The suites, one subcommand each, with their own sizes.
#[derive(Debug, Subcommand)]
pub enum Suite {
    /// Every bootstrap-server route at every concurrency.
    Bootstrap,
    /// SGLang's bootstrap routes, beside SGLang's own server with --sglang-venv.
    Sglang,
    /// The curves a capacity planner needs: memory, lookups and restart time vs live request
    /// ids (10,000 workers), `GET /query` vs registered workers, watch fan-out vs watchers,
    /// pd-proxy vs clients in flight and vs backends.
    Scale {
        /// Live request ids to load (repeatable sizes, comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "100000,1000000,10000000")]
        ids: Vec<u64>,
        /// Registered workers for the `GET /query` curve (comma-separated).
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "10,100,1000,10000,100000"
        )]
        workers: Vec<u32>,
        /// Watchers for the watch fan-out curve (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "10,100,500,2000")]
        watchers: Vec<usize>,
        /// Clients in flight for pd-proxy's concurrency curve (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256,1024")]
        proxy_concurrency: Vec<usize>,
        /// Backends behind pd-proxy for its backends curve, half prefills and half decodes
        /// (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "2,8,32,128,256")]
        proxy_backends: Vec<usize>,
    },
    /// Completions through the proxy (and the peers) to instant mocks, against D directly.
    Proxy,
    /// What TLS (from the client, to the engines, both) and tenant keys with limits cost the
    /// front door: whole completions to instant mocks, beside the peers that support the same.
    Security,
    /// pd-epp, the endpoint picker: picks per second over ext_proc and the decision's latency
    /// (P/D and engines alone), pd-epp's CPU per pick; completions through Envoy with pd-epp
    /// against Envoy alone.
    Epp {
        /// The Envoy binary (default: what examples/gateway/tools.sh installs).
        #[arg(long)]
        envoy: Option<PathBuf>,
    },
    /// Overload: simulated engines with a batch limit at 1x, 2x and 3x their capacity, a mix
    /// of interactive (TTFT target), standard and sheddable requests from four tenants (one
    /// noisy); pd-proxy with and without flow control, and the peers with --peers-venv:
    /// goodput, interactive TTFT, refusals by class, the tenants' fairness.
    Overload {
        /// Loads, as multiples of the engines' capacity (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
        loads: Vec<f64>,
    },
    /// A decode lost mid-answer: the time from killing (SIGKILL) or freezing (SIGSTOP) the
    /// decode streaming an answer to the client's next token, over repeated faults, with sim
    /// engines (and the real vLLM CPU engines with --real).
    Migration {
        /// Faults of each kind.
        #[arg(long, default_value_t = 20)]
        faults: usize,
        /// Also with the real vLLM CPU engines (examples/vllm/cpu/venv.sh's environment): two
        /// kills and --faults freezes.
        #[arg(long)]
        real: bool,
    },
    /// TTFT with simulated engines: the proxy's concurrent fan-out against sequential P-then-D.
    Ttft {
        /// Streamed requests per mode and concurrency.
        #[arg(long, default_value_t = 40)]
        requests: usize,
    },
    /// A multi-turn chat workload through simulated engines with prefix caches, once per
    /// routing setup (round robin, least loaded, consistent hash, cache aware, cache aware with
    /// decode-only on prefix hits): prefix hit rate, TTFT, throughput.
    Routing {
        /// Conversations.
        #[arg(long, default_value_t = 200)]
        sessions: usize,
        /// Turns per conversation.
        #[arg(long, default_value_t = 5)]
        turns: usize,
        /// Conversations at once.
        #[arg(long, default_value_t = 16)]
        parallel: usize,
        /// Distinct system prompts the conversations share.
        #[arg(long, default_value_t = 8)]
        system_prompts: usize,
    },
    /// Many tenants, each with a long system prompt its users share, through two proxy
    /// replicas in front of prefills whose caches hold the tenants' prompts once, not twice, once
    /// per policy (round robin, cache aware, precise prefix): prefix hit rate, TTFT,
    /// throughput.
    Tenants {
        /// Tenants.
        #[arg(long, default_value_t = 50)]
        tenants: usize,
        /// Users per tenant.
        #[arg(long, default_value_t = 32)]
        users: usize,
        /// Requests per user.
        #[arg(long, default_value_t = 1)]
        requests: usize,
        /// Users at once.
        #[arg(long, default_value_t = 24)]
        parallel: usize,
        /// Blocks of 16 tokens each engine's prefix cache holds.
        #[arg(long, default_value_t = 1200)]
        cache_blocks: usize,
        /// Run only these setups (repeatable): round_robin, cache_aware, precise_prefix.
        #[arg(long)]
        only: Vec<String>,
    },
    /// pd-proxy's KV block index in process, on one thread: block events ingested per second,
    /// the time to match a 2,048-token prompt against the engines, memory per million blocks.
    KvIndex {
        /// Engines sending events, and holding the matched prompt's blocks.
        #[arg(long, default_value_t = 1000)]
        engines: u32,
        /// Rounds of traffic: one 16-block event per engine each.
        #[arg(long, default_value_t = 120)]
        rounds: u32,
        /// Matches timed per prompt with the caches warm.
        #[arg(long, default_value_t = 20_000)]
        matches: u32,
        /// A model's folder whose tokenizer is timed too (beside the sims' one token per
        /// byte), e.g. the tiny model real-vLLM tests make.
        #[arg(long)]
        tokenizer: Option<PathBuf>,
    },
    /// KV pull bandwidth between two processes (UCX over shared memory and TCP, and the TCP
    /// transport) beside memcpy; needs the binaries built with --all-features.
    Transfer {
        /// MiB per pull.
        #[arg(long, default_value_t = 64)]
        mib: usize,
        /// Pulls measured per transport (after one warm-up pull).
        #[arg(long, default_value_t = 8)]
        pulls: usize,
    },
    /// Real vLLM engines (CPU build, tiny model, Mooncake): TTFT and total time through
    /// pd-proxy against the same P and D calls made directly. Not in `all`.
    RealVllm {
        /// Requests per path and streaming mode (one at a time, after one warm-up each).
        #[arg(long, default_value_t = 40)]
        requests: usize,
    },
    /// Public production traces (`../shared/bench/traces/`: Mooncake's JSONL, Azure's CSV),
    /// replayed in arrival order without timing on engines whose prefix caches are LRU sets of
    /// the traces' blocks: each routing rule's prefix hit rate and load spread, as the traces'
    /// oracle (`cache_sim.py`) computes them. Not in `all`.
    Fleet {
        /// Trace files (repeatable, or comma-separated); each is read and checked whole before
        /// anything is replayed.
        #[arg(long = "trace", value_delimiter = ',', required = true)]
        traces: Vec<PathBuf>,
        /// Replay the requests arriving from this second of each trace ...
        #[arg(long, default_value = "0", value_parser = seconds)]
        from: Duration,
        /// ... until this second (default: its end).
        #[arg(long, value_parser = seconds)]
        to: Option<Duration>,
        /// Join the traces' windows back to back into one replay whose shape shifts (the first
        /// window, then the second, ...), each window's arrivals at its own rate multiplier
        /// (comma-separated, one per trace; none: each at its own rate) before the sweep's.
        #[arg(long, value_delimiter = ',', num_args = 0.., value_parser = positive)]
        shift: Option<Vec<f64>>,
        /// Engines.
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        engines: u32,
        /// Tokens of prefix cache per engine.
        #[arg(long, default_value_t = 3_000_000)]
        cache_tokens: u64,
        /// The bounded-load rule's slack: engines loaded above (1 + this) times the mean (plus
        /// one token) are passed over.
        #[arg(long, default_value_t = 0.05, value_parser = non_negative)]
        eps: f64,
        /// The random rule's seed (Python's `random.Random(seed)`).
        #[arg(long, default_value_t = 0)]
        seed: u32,
        /// Then replay each trace timed, open-loop on its timestamps, through each system on a
        /// fleet of sim-engines running the engine model.
        #[arg(long)]
        timed: bool,
        /// Timed: the fleets' P:D splits, each `PREFILLS:DECODES` (comma-separated: a split
        /// sweep, every system on each).
        #[arg(long, value_delimiter = ',', default_value = "8:8", value_parser = split)]
        splits: Vec<(usize, usize)>,
        /// Timed: the engines' model (sim-engine's --engine-model).
        #[arg(long, value_enum, default_value = "llama3-8b-h200")]
        engine_model: crate::sim::model::Preset,
        /// Timed: the engines and the arrivals run this many times faster than the GPU
        /// modelled; times are reported in the GPU's.
        #[arg(long, default_value_t = 10.0, value_parser = positive)]
        time_scale: f64,
        /// Timed: rate multipliers swept for goodput (1: the trace's own arrivals).
        #[arg(long, value_delimiter = ',', default_value = "0.5,1,2", value_parser = positive)]
        rates: Vec<f64>,
        /// Timed: the TTFT target, seconds.
        #[arg(long, default_value = "2", value_parser = seconds)]
        ttft_slo: Duration,
        /// Timed: the TPOT target, seconds.
        #[arg(long, default_value = "0.1", value_parser = seconds)]
        tpot_slo: Duration,
        /// Timed: at most this many requests of each trace window.
        #[arg(long)]
        max_requests: Option<usize>,
        /// Timed: only the systems whose names contain one of these (comma-separated; e.g.
        /// `round_robin,vllm-router`).
        #[arg(long, value_delimiter = ',')]
        systems: Vec<String>,
        /// Timed: an engine's start-up in seconds of GPU time, as the autoscaled runs model it
        /// (thawed at once, taken into rotation this much later).
        #[arg(long, default_value = "30", value_parser = seconds)]
        start_delay: Duration,
        /// Timed: the safe time (seconds of GPU time) before the autoscaled runs' planner
        /// desires one engine fewer (pd-proxy's `--planner-scale-down-after`; its default).
        #[arg(long, default_value = "300", value_parser = seconds)]
        scale_down_after: Duration,
    },
    /// Everything above but real-vllm, overload and fleet, one section each.
    All,
}

/// A number of seconds, at least 0.
fn seconds(text: &str) -> Result<Duration, String> {
    let seconds = non_negative(text)?;
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("`{text}` seconds is too long"))
}

/// `P:D`, engines of each role, 1 to 256 each.
fn split(text: &str) -> Result<(usize, usize), String> {
    let engines = |n: &str| match n.trim().parse::<usize>() {
        Ok(n) if (1..=256).contains(&n) => Ok(n),
        _ => Err(format!("`{text}`: each side of P:D is 1 to 256 engines")),
    };
    let (prefills, decodes) =
        (text.split_once(':')).ok_or_else(|| format!("`{text}` is not PREFILLS:DECODES"))?;
    Ok((engines(prefills)?, engines(decodes)?))
}

/// A finite number above 0.
fn positive(text: &str) -> Result<f64, String> {
    match non_negative(text)? {
        0.0 => Err(format!("`{text}` is not a number above 0")),
        value => Ok(value),
    }
}

/// A finite number, at least 0.
fn non_negative(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(value) if value.is_finite() && value >= 0.0 => Ok(value),
        _ => Err(format!("`{text}` is not a number of at least 0")),
    }
}
