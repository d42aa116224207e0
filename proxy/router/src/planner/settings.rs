//! The planner's flags (`--planner-*`, the `[planner]` section of `--config`) and their
//! validated form: off unless both latency targets are given.

use std::time::Duration;

use clap::Args;
use pd_service::parse_seconds;

use super::{Bounds, PlannerConfig};
use crate::config::ConfigError;

/// The planner's flags, flattened into the fleet's.
#[derive(Debug, Clone, Args)]
pub struct PlannerArgs {
    /// Seconds of TTFT the prefills must give the mean prompt: with --planner-tpot-target,
    /// turns the capacity planner on (desired engines per model and role, as metrics and on
    /// the live page).
    #[arg(long, env = "PD_PROXY_PLANNER_TTFT_TARGET", value_parser = parse_seconds)]
    pub planner_ttft_target: Option<Duration>,
    /// Seconds per output token the decodes must give.
    #[arg(long, env = "PD_PROXY_PLANNER_TPOT_TARGET", value_parser = parse_seconds)]
    pub planner_tpot_target: Option<Duration>,
    /// Seconds of traffic the demand is measured over.
    #[arg(long, env = "PD_PROXY_PLANNER_WINDOW", default_value = "60", value_parser = parse_seconds)]
    pub planner_window: Duration,
    /// Seconds a scale-down must stay safe before one engine fewer is desired (and between two
    /// steps down).
    #[arg(long, env = "PD_PROXY_PLANNER_SCALE_DOWN_AFTER", default_value = "300", value_parser = parse_seconds)]
    pub planner_scale_down_after: Duration,
    /// Seconds between two decisions.
    #[arg(long, env = "PD_PROXY_PLANNER_INTERVAL", default_value = "5", value_parser = parse_seconds)]
    pub planner_interval: Duration,
    /// Engines per role never desired fewer than this.
    #[arg(long, env = "PD_PROXY_PLANNER_MIN_ENGINES", default_value_t = 1)]
    pub planner_min_engines: usize,
    /// Engines per role never desired more than this.
    #[arg(long, env = "PD_PROXY_PLANNER_MAX_ENGINES", default_value_t = 64)]
    pub planner_max_engines: usize,
    /// The batch a decode runs at most, until its metrics show its own (vLLM's
    /// `--max-num-seqs`).
    #[arg(long, env = "PD_PROXY_PLANNER_MAX_BATCH", default_value_t = 256)]
    pub planner_max_batch: usize,
}

impl PlannerArgs {
    /// The validated form: `None` when the planner is off.
    pub fn config(&self) -> Result<Option<PlannerConfig>, ConfigError> {
        let (ttft_target, tpot_target) = match (self.planner_ttft_target, self.planner_tpot_target)
        {
            (None, None) => return Ok(None),
            (Some(ttft), Some(tpot)) => (ttft, tpot),
            (Some(_), None) => {
                return Err(invalid(
                    "--planner-tpot-target",
                    "needed with --planner-ttft-target",
                ))
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "--planner-ttft-target",
                    "needed with --planner-tpot-target",
                ))
            }
        };
        if self.planner_min_engines == 0 || self.planner_max_engines < self.planner_min_engines {
            return Err(invalid(
                "--planner-max-engines",
                "must be at least --planner-min-engines, itself at least 1",
            ));
        }
        if self.planner_max_batch == 0 {
            return Err(invalid("--planner-max-batch", "must be at least 1"));
        }
        let config = PlannerConfig {
            ttft_target,
            tpot_target,
            window: self.planner_window,
            bounds: Bounds {
                min: self.planner_min_engines,
                max: self.planner_max_engines,
                scale_down_after: self.planner_scale_down_after,
            },
            max_batch: self.planner_max_batch,
            interval: self.planner_interval,
        };
        Ok(Some(config))
    }
}

fn invalid(flag: &str, why: &str) -> ConfigError {
    ConfigError::Planner(format!("{flag} {why}"))
}
