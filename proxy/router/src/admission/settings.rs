//! The admission flags (`--admission*`, `--retry-budget*`) and their validated form; the
//! objectives' priorities come from `--config`'s `[objectives]` table.

use std::collections::BTreeMap;
use std::time::Duration;

use clap::Args;
use pd_service::parse_seconds;

/// How requests are admitted under overload.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionConfig {
    /// Whether requests wait while the pool is saturated (off: every request is placed at
    /// once, as without flow control).
    pub enabled: bool,
    /// The most requests that wait at once.
    pub queue_length: usize,
    /// The longest a request waits (its own deadline may be sooner).
    pub max_wait: Duration,
    /// The `Retry-After` told to a refused request.
    pub retry_after: Duration,
    /// Objective name -> priority (`[objectives]` of `--config`).
    pub objectives: BTreeMap<String, i32>,
    /// The share of recent requests that may be retried (0: no retries).
    pub retry_budget_ratio: f64,
    /// Retries allowed per second whatever the traffic.
    pub retry_budget_floor: f64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            enabled: true,
            queue_length: 1024,
            max_wait: Duration::from_secs(10),
            retry_after: Duration::from_secs(1),
            objectives: BTreeMap::new(),
            retry_budget_ratio: 0.2,
            retry_budget_floor: 5.0,
        }
    }
}

/// The admission flags, flattened into the fleet's.
#[derive(Debug, Clone, Args)]
pub struct AdmissionArgs {
    /// Whether requests wait in a queue while every engine that could take them is saturated
    /// (`--saturation-*`): `on` or `off` (every request placed at once).
    #[arg(long, env = "PD_PROXY_ADMISSION", default_value = "on", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    pub admission: bool,
    /// The most requests that wait at once; more are refused (429), or displace a waiting
    /// request of lower priority.
    #[arg(long, env = "PD_PROXY_ADMISSION_QUEUE_LENGTH", default_value_t = 1024)]
    pub admission_queue_length: usize,
    /// Seconds a request may wait to be admitted (less when its deadline is sooner) before
    /// it is refused with 429.
    #[arg(long, env = "PD_PROXY_ADMISSION_MAX_WAIT", default_value = "10", value_parser = parse_seconds)]
    pub admission_max_wait: Duration,
    /// Seconds a refused request is told to wait (`Retry-After`).
    #[arg(long, env = "PD_PROXY_ADMISSION_RETRY_AFTER", default_value = "1", value_parser = parse_seconds)]
    pub admission_retry_after: Duration,
    /// The share of recent requests (10 s) that may be retried on another engine (D's retry,
    /// a re-send after P's engine changed); 0: none.
    #[arg(long, env = "PD_PROXY_RETRY_BUDGET_RATIO", default_value_t = 0.2)]
    pub retry_budget_ratio: f64,
    /// Retries allowed per second whatever the traffic, so a quiet proxy still retries.
    #[arg(long, env = "PD_PROXY_RETRY_BUDGET_FLOOR", default_value_t = 5.0)]
    pub retry_budget_floor: f64,
}

impl AdmissionArgs {
    /// The validated form, with the objectives of `--config`.
    pub fn config(&self, objectives: BTreeMap<String, i32>) -> AdmissionConfig {
        AdmissionConfig {
            enabled: self.admission,
            queue_length: self.admission_queue_length,
            max_wait: self.admission_max_wait,
            retry_after: self.admission_retry_after.max(Duration::from_secs(1)),
            objectives,
            retry_budget_ratio: self.retry_budget_ratio.clamp(0.0, 1.0),
            retry_budget_floor: self.retry_budget_floor.max(0.0),
        }
    }
}
