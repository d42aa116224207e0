//! How long prefills and tokens take: the linear timers (`--prefill-us-per-token`,
//! `--decode-ms-per-token`, `--prefill-concurrency`) or, with `--engine-model`, each dp rank's
//! step loop; and the load `/metrics` reports from whichever runs.

use std::time::Duration;

use super::Engine;
use crate::sim::api::Prompt;
use crate::sim::model::steps::{Steps, TooLong};
use crate::sim::model::Coefficients;
use crate::sim::pace::Pace;
use crate::sim::SimArgs;

/// The load an engine reports: requests running and waiting, the share of KV in use.
pub(super) struct Load {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    /// Requests preempted so far (the engine model's; the linear timers never preempt).
    pub preemptions: u64,
}

/// A step loop per dp rank (none without `--engine-model`).
pub(super) fn step_loops(args: &SimArgs, model: Option<Coefficients>) -> Vec<Steps> {
    let Some(model) = model else {
        return Vec::new();
    };
    (0..args.dp_size)
        .map(|_| Steps::start(model, args.max_num_seqs, args.model_args.time_scale))
        .collect()
}

impl Engine {
    /// Computes `prompt` on its dp rank, which then makes `tokens` tokens (P: its one), and
    /// gives the pace of the rest: with the engine model, once the step that ends the prompt
    /// has run; else once the dp rank's compute is free (`--prefill-concurrency`), after the
    /// time its tokens not in the prefix cache take.
    pub(super) async fn prefill(&self, prompt: &Prompt, tokens: u32) -> Pace {
        let cached = self
            .prefix_cache(prompt)
            .map_or(0, |cache| cache.compute(prompt.blocks()));
        if let Some(steps) = self.steps.get(prompt.dp as usize) {
            let mut progress = steps.submit(prompt.token_count(), cached, tokens);
            let _ = progress.wait_for(|made| *made >= 1).await;
            return Pace::steps(progress);
        }
        let _turn = match self.compute.get(prompt.dp as usize) {
            Some(compute) => compute.acquire().await.ok(),
            None => None,
        };
        let uncached = u64::from(prompt.token_count() - cached);
        tokio::time::sleep(Duration::from_micros(
            self.args.prefill_us_per_token * uncached,
        ))
        .await;
        self.fixed_pace()
    }

    /// The pace of a decode whose prompt's KV was pulled from a prefill: the engine model's
    /// steps from the whole prompt's KV on, or the fixed pace.
    pub(super) fn decode_pace(&self, prompt: &Prompt) -> Pace {
        match self.steps.get(prompt.dp as usize) {
            Some(steps) => {
                let n = prompt.token_count();
                Pace::steps(steps.submit(n, n, prompt.planned().0))
            }
            None => self.fixed_pace(),
        }
    }

    fn fixed_pace(&self) -> Pace {
        Pace::Fixed {
            scheduler: self.scheduler.clone(),
            per_token: Duration::from_millis(self.args.decode_ms_per_token),
        }
    }

    /// Refuses, under the engine model, a request that its dp rank's KV can never hold.
    pub(super) fn check_fits(&self, prompt: &Prompt) -> Result<(), TooLong> {
        match self.steps.get(prompt.dp as usize) {
            Some(steps) => steps.check_fits(prompt.token_count(), prompt.max_tokens),
            None => Ok(()),
        }
    }

    /// Requests running and waiting and the KV in use, of every dp rank together.
    pub(super) fn load(&self) -> Load {
        if self.steps.is_empty() {
            return Load {
                running: self.scheduler.running(),
                waiting: self.scheduler.waiting(),
                kv_usage: self.scheduler.kv_usage(),
                preemptions: 0,
            };
        }
        let (mut running, mut waiting, mut used, mut capacity, mut preemptions) = (0, 0, 0, 0, 0);
        for steps in &self.steps {
            let load = steps.load();
            running += load.running;
            waiting += load.waiting;
            used += load.kv_tokens;
            preemptions += load.preemptions;
            capacity += steps.capacity();
        }
        Load {
            running,
            waiting,
            kv_usage: used as f64 / capacity.max(1) as f64,
            preemptions,
        }
    }
}
