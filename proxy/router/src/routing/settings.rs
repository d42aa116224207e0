//! The routing flags: a policy for each choice (`--prefill-policy`, `--decode-policy`), the
//! cache-aware and session knobs, and conditional disaggregation; and their validated form.

use clap::{Args, ValueEnum};

/// How backends are chosen for each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Policy {
    /// Take the candidates in turn.
    #[default]
    #[value(name = "round_robin", alias = "round-robin")]
    RoundRobin,
    /// Power of two random choices: of two random backends, take the one with fewer requests
    /// outstanding.
    #[value(name = "least_loaded", alias = "least-loaded")]
    LeastLoaded,
    /// The backend that served the longest prefix of the prompt (its prefix cache holds it),
    /// unless loads are out of balance or the match is too small: then the least loaded.
    #[value(name = "cache_aware", alias = "cache-aware")]
    CacheAware,
    /// Rendezvous hash of the session key (`--session-header`, else the body's `user`) with
    /// bounded load; requests without a key go to the least loaded.
    #[value(name = "consistent_hash", alias = "consistent-hash")]
    ConsistentHash,
    /// The backend with the least work for the request by the engines' own KV cache events
    /// (the prompt's uncached tokens there, plus its load weighed by --kv-load-weight); turns
    /// on --kv-events. Without known events or tokens: cache_aware.
    #[value(name = "precise_prefix", alias = "precise-prefix")]
    PrecisePrefix,
}

impl Policy {
    /// Its flag value (`round_robin`, `precise_prefix`...), as clap names it.
    pub fn name(self) -> String {
        let value = self.to_possible_value().expect("no policy is skipped");
        value.get_name().to_owned()
    }

    /// Whether the policy routes on the engines' KV cache events.
    pub fn follows_kv_events(self) -> bool {
        self == Policy::PrecisePrefix
    }

    /// Whether the policy knows how much of a prompt a backend holds (for
    /// --decode-only-prefix-share).
    pub fn knows_prefixes(self) -> bool {
        matches!(self, Policy::CacheAware | Policy::PrecisePrefix)
    }
}

/// What to do when no prefill can take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Fallback {
    /// Fail the request with a 503 naming why.
    #[default]
    None,
    /// Send it to a decode alone (it computes the prompt itself); counted and logged.
    #[value(name = "decode-only", alias = "decode_only")]
    DecodeOnly,
}

/// The routing flags, flattened into pd-proxy's.
#[derive(Debug, Clone, Args)]
pub struct RoutingArgs {
    /// How (prefill, dp rank) pairs are chosen (default: --policy).
    #[arg(long, env = "PD_PROXY_PREFILL_POLICY", value_enum)]
    pub prefill_policy: Option<Policy>,
    /// How decodes are chosen (default: --policy).
    #[arg(long, env = "PD_PROXY_DECODE_POLICY", value_enum)]
    pub decode_policy: Option<Policy>,
    /// cache_aware: the share of the prompt (0 to 1) a backend must already hold for the match
    /// to decide.
    #[arg(long, env = "PD_PROXY_CACHE_THRESHOLD", default_value_t = 0.5, value_parser = share)]
    pub cache_threshold: f64,
    /// cache_aware: loads (requests outstanding) count as balanced while they differ by at most
    /// this many ...
    #[arg(long, env = "PD_PROXY_BALANCE_ABS_THRESHOLD", default_value_t = 32)]
    pub balance_abs_threshold: usize,
    /// ... or the largest is at most this factor times the smallest; out of balance, the least
    /// loaded wins whatever the matches.
    #[arg(long, env = "PD_PROXY_BALANCE_REL_THRESHOLD", default_value_t = 1.5, value_parser = factor)]
    pub balance_rel_threshold: f64,
    /// cache_aware: (prefix block, backend) entries remembered per choice (prefill, decode),
    /// least recently used forgotten first; about 100 bytes each.
    #[arg(long, env = "PD_PROXY_CACHE_MAX_BLOCKS", default_value_t = 262_144, value_parser = clap::value_parser!(u64).range(1..))]
    pub cache_max_blocks: u64,
    /// consistent_hash: the request header carrying the session key (else the body's `user`).
    #[arg(long, env = "PD_PROXY_SESSION_HEADER", default_value = "x-session-id", value_parser = header_name)]
    pub session_header: String,
    /// consistent_hash: a session's backend may hold at most this factor times the average
    /// load before the session moves to the next in its order.
    #[arg(long, env = "PD_PROXY_HASH_LOAD_FACTOR", default_value_t = 1.25, value_parser = factor)]
    pub hash_load_factor: f64,
    /// precise_prefix: what a token of work waiting on a backend weighs against a token of the
    /// prompt it would compute: a backend's cost is the prompt's tokens it does not hold plus
    /// this weight times the tokens queued on it. Below 1 because a prompt computed where its
    /// prefix is not also evicts another's there.
    #[arg(long, env = "PD_PROXY_KV_LOAD_WEIGHT", default_value_t = 0.25, value_parser = weight)]
    pub kv_load_weight: f64,
    /// Conditional disaggregation: send prompts shorter than this many characters to a decode
    /// alone (it computes them itself, no KV transfer). 0: off.
    #[arg(long, env = "PD_PROXY_DECODE_ONLY_BELOW_CHARS", default_value_t = 0)]
    pub decode_only_below_chars: usize,
    /// Conditional disaggregation: send a prompt to a decode alone when a decode already holds
    /// at least this share (0 to 1) of it (needs --decode-policy cache_aware or precise_prefix).
    /// Off when unset.
    #[arg(long, env = "PD_PROXY_DECODE_ONLY_PREFIX_SHARE", value_parser = share)]
    pub decode_only_prefix_share: Option<f64>,
    /// What to do when no prefill can take a request: `none` (a 503) or `decode-only`.
    #[arg(long, env = "PD_PROXY_FALLBACK", value_enum, default_value_t = Fallback::None)]
    pub fallback: Fallback,
}

/// The cache-aware policy's knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareConfig {
    /// Share of the prompt a match must cover to decide.
    pub threshold: f64,
    /// Loads within this absolute difference are balanced.
    pub balance_abs_threshold: usize,
    /// ... or within this factor.
    pub balance_rel_threshold: f64,
    /// Entries of the prefix index.
    pub max_blocks: usize,
}

/// The consistent-hash policy's knobs.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionConfig {
    /// The header with the session key (lower case).
    pub header: String,
    /// Bounded load: at most this factor times the average.
    pub load_factor: f64,
}

/// When a request skips P.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DecodeOnlyRules {
    /// Prompts shorter than this many characters (0: never).
    pub below_chars: usize,
    /// Prompts a decode holds at least this share of.
    pub prefix_share: Option<f64>,
    /// What to do when no prefill can take the request.
    pub fallback: Fallback,
}

/// Everything about routing, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingConfig {
    /// The policy of the (prefill, dp rank) choice.
    pub prefill_policy: Policy,
    /// The policy of the decode choice.
    pub decode_policy: Policy,
    /// cache_aware's knobs.
    pub cache: CacheAwareConfig,
    /// consistent_hash's knobs.
    pub session: SessionConfig,
    /// precise_prefix: the weight of a backend's load against the tokens it does not hold.
    pub kv_load_weight: f64,
    /// Conditional disaggregation.
    pub decode_only: DecodeOnlyRules,
}

impl RoutingConfig {
    /// `policy` for both choices, every knob at its default, disaggregation unconditional.
    pub fn with_policy(policy: Policy) -> Self {
        RoutingConfig {
            prefill_policy: policy,
            decode_policy: policy,
            cache: CacheAwareConfig {
                threshold: 0.5,
                balance_abs_threshold: 32,
                balance_rel_threshold: 1.5,
                max_blocks: 262_144,
            },
            session: SessionConfig {
                header: "x-session-id".to_owned(),
                load_factor: 1.25,
            },
            kv_load_weight: 0.25,
            decode_only: DecodeOnlyRules::default(),
        }
    }
}

impl RoutingArgs {
    /// The validated form, with `policy` (`--policy`) where no per-choice policy was given.
    pub fn config(&self, policy: Policy) -> RoutingConfig {
        RoutingConfig {
            prefill_policy: self.prefill_policy.unwrap_or(policy),
            decode_policy: self.decode_policy.unwrap_or(policy),
            cache: CacheAwareConfig {
                threshold: self.cache_threshold,
                balance_abs_threshold: self.balance_abs_threshold,
                balance_rel_threshold: self.balance_rel_threshold,
                max_blocks: usize::try_from(self.cache_max_blocks).unwrap_or(usize::MAX),
            },
            session: SessionConfig {
                header: self.session_header.clone(),
                load_factor: self.hash_load_factor,
            },
            kv_load_weight: self.kv_load_weight,
            decode_only: DecodeOnlyRules {
                below_chars: self.decode_only_below_chars,
                prefix_share: self.decode_only_prefix_share,
                fallback: self.fallback,
            },
        }
    }
}

fn share(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if (0.0..=1.0).contains(&value) => Ok(value),
        _ => Err(format!("{text:?} is not a share between 0 and 1")),
    }
}

fn factor(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if value >= 1.0 && value.is_finite() => Ok(value),
        _ => Err(format!("{text:?} is not a factor of at least 1")),
    }
}

fn weight(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(value) if value >= 0.0 && value.is_finite() => Ok(value),
        _ => Err(format!("{text:?} is not a weight of 0 or more")),
    }
}

fn header_name(text: &str) -> Result<String, String> {
    http::HeaderName::from_bytes(text.as_bytes())
        .map(|name| name.as_str().to_owned())
        .map_err(|_| format!("{text:?} is not a header name"))
}
