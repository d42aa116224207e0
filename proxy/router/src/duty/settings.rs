//! The flags of engines that serve both roles: the split they start with, how long an engine
//! keeps a duty before it may change again, and how long a new direction's warm-up may take.

use std::time::Duration;

use clap::Args;

use pd_service::parse_seconds;

/// The duty flags (with `--dual`).
#[derive(Debug, Clone, Args)]
pub struct DutyArgs {
    /// Engines of `--dual` on prefill duty at start (default: half, rounded up); the rest
    /// decode. With the capacity planner on, the split then follows its plans.
    #[arg(long, env = "PD_PROXY_DUAL_PREFILLS")]
    pub dual_prefills: Option<usize>,
    /// Seconds between two changes of duty in a model's pool (one engine moves at a time).
    #[arg(long, env = "PD_PROXY_DUTY_DWELL", default_value = "30", value_parser = parse_seconds)]
    pub duty_dwell: Duration,
    /// Seconds the warm-up of an engine's new direction (one request with each engine of the
    /// other duty) may take; one that fails or runs out of time leaves the duty as it was.
    #[arg(long, env = "PD_PROXY_DUTY_WARMUP_TIMEOUT", default_value = "30", value_parser = parse_seconds)]
    pub duty_warmup_timeout: Duration,
}

/// How the duties of `--dual` engines are set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DutyConfig {
    /// Engines on prefill duty at start (none: half, rounded up).
    pub initial_prefills: Option<usize>,
    /// The least time between two changes in a model's pool.
    pub dwell: Duration,
    /// How long a new direction's warm-up may take.
    pub warmup_timeout: Duration,
}

impl DutyArgs {
    /// The configuration of these flags.
    pub fn config(&self) -> DutyConfig {
        DutyConfig {
            initial_prefills: self.dual_prefills,
            dwell: self.duty_dwell,
            warmup_timeout: self.duty_warmup_timeout,
        }
    }
}

impl Default for DutyConfig {
    fn default() -> Self {
        DutyConfig {
            initial_prefills: None,
            dwell: Duration::from_secs(30),
            warmup_timeout: Duration::from_secs(30),
        }
    }
}
