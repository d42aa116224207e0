//! The engine model (`--engine-model`): how long a GPU engine's steps take, instead of the
//! linear timers of `--prefill-us-per-token` and `--decode-ms-per-token`.
//!
//! An engine runs in steps, as vLLM's and SGLang's schedulers do: every step advances each
//! decoding request by one token and spends what is left of a token budget
//! (`--max-num-batched-tokens`, chunked prefill) on the prompts in flight, first come first
//! served. A step costs
//!
//! - for its prefill chunks, `c0 + Σ k_lin·k + k_att·((c+k)² − c²)` for a chunk of k tokens after c
//!   already computed (a whole prompt of n tokens with p cached sums to
//!   `c0 + k_lin·(n−p) + k_att·(n²−p²)`: the attention term is quadratic);
//! - for its decodes, `w + ctx·Σctx + c·B` for B requests whose contexts sum to Σctx (the
//!   weights read once, each context's KV read once: memory bound, `ctx` being the KV bytes of a
//!   token over the bandwidth really reached);
//!
//! with the larger of `c0` and `w` paid once when a step holds both. KV capacity is in tokens:
//! a request holds its context's; a request that would overflow it waits, and a decode step that
//! would overflow it preempts the request admitted last (its KV freed, recomputed later), as
//! vLLM does. [`presets`] names model/GPU pairs with their sources; `--engine-model-set` changes
//! any coefficient; `--time-scale K` divides every step's time by K, so an hour of trace
//! replays in minutes.

pub mod presets;
pub mod steps;

use clap::Args;

pub use presets::Preset;

/// The coefficients of one engine (one data-parallel rank: a GPU, or a TP group), in
/// milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Coefficients {
    /// A prefill step's fixed cost.
    pub c0_ms: f64,
    /// Per prompt token computed.
    pub k_lin_ms: f64,
    /// Per token² of causal attention.
    pub k_att_ms: f64,
    /// A decode step's fixed cost (reading the weights).
    pub w_ms: f64,
    /// Per token of context in a decode step (KV bytes per token over η·bandwidth).
    pub ctx_ms: f64,
    /// Per request in a decode step.
    pub c_ms: f64,
    /// Tokens one step computes at most (vLLM's `--max-num-batched-tokens`).
    pub token_budget: u32,
    /// KV cache capacity in tokens.
    pub kv_capacity_tokens: u64,
}

/// vLLM's `max_num_batched_tokens` for its API server on data-centre GPUs.
pub const DEFAULT_TOKEN_BUDGET: u32 = 8192;

impl Coefficients {
    /// The time of computing `k` prompt tokens after `computed` (no fixed cost).
    pub fn chunk_ms(&self, computed: u32, k: u32) -> f64 {
        let (c, k) = (f64::from(computed), f64::from(k));
        self.k_lin_ms * k + self.k_att_ms * ((c + k) * (c + k) - c * c)
    }

    /// A whole prefill of `n` prompt tokens with `p` cached, in one step.
    pub fn prefill_ms(&self, n: u32, p: u32) -> f64 {
        self.c0_ms + self.chunk_ms(p, n.saturating_sub(p))
    }

    /// A decode step of `batch` requests whose contexts sum to `context` tokens.
    pub fn decode_ms(&self, context: u64, batch: usize) -> f64 {
        self.w_ms + self.ctx_ms * context as f64 + self.c_ms * batch as f64
    }

    /// Sets one coefficient from `name=value` (`--engine-model-set`).
    fn set(&mut self, assignment: &str) -> Result<(), String> {
        let (name, value) = assignment
            .split_once('=')
            .ok_or_else(|| format!("`{assignment}`: expected NAME=VALUE"))?;
        let number = || -> Result<f64, String> {
            match value.trim().parse::<f64>() {
                Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
                _ => Err(format!("`{name}`: `{value}` is not a non-negative number")),
            }
        };
        let count = |what: &str| -> Result<u64, String> {
            match value.trim().parse::<u64>() {
                Ok(v) if v > 0 => Ok(v),
                _ => Err(format!("`{name}`: `{value}` is not a positive {what}")),
            }
        };
        match name.trim() {
            "c0_ms" => self.c0_ms = number()?,
            "k_lin_ms" => self.k_lin_ms = number()?,
            "k_att_ms" => self.k_att_ms = number()?,
            "w_ms" => self.w_ms = number()?,
            "ctx_ms" => self.ctx_ms = number()?,
            "c_ms" => self.c_ms = number()?,
            "token_budget" => {
                self.token_budget = u32::try_from(count("token count")?)
                    .map_err(|_| format!("`{name}`: `{value}` is too large"))?
            }
            "kv_capacity_tokens" => self.kv_capacity_tokens = count("token count")?,
            other => {
                return Err(format!(
                    "`{other}` is not a coefficient (c0_ms, k_lin_ms, k_att_ms, w_ms, ctx_ms, \
                     c_ms, token_budget, kv_capacity_tokens)"
                ))
            }
        }
        Ok(())
    }
}

/// The engine model's flags.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Time prefills and decodes by an engine model of this model/GPU pair (steps, chunked
    /// prefill, a KV capacity) instead of --prefill-us-per-token and --decode-ms-per-token.
    #[arg(long, env = "SIM_ENGINE_MODEL", value_enum)]
    pub engine_model: Option<Preset>,
    /// Changes a coefficient of the engine model, `NAME=VALUE` (c0_ms, k_lin_ms, k_att_ms,
    /// w_ms, ctx_ms, c_ms, token_budget, kv_capacity_tokens); repeatable.
    #[arg(long, value_name = "NAME=VALUE", requires = "engine_model")]
    pub engine_model_set: Vec<String>,
    /// The engine model's steps take their time divided by this (10: ten times faster than
    /// the GPU modelled).
    #[arg(long, env = "SIM_TIME_SCALE", default_value_t = 1.0, value_parser = time_scale, requires = "engine_model")]
    pub time_scale: f64,
}

impl ModelArgs {
    /// The coefficients chosen (a preset with its changes), or none without `--engine-model`.
    pub fn coefficients(&self) -> Result<Option<Coefficients>, String> {
        let Some(preset) = self.engine_model else {
            return Ok(None);
        };
        let mut coefficients = preset.coefficients();
        for assignment in &self.engine_model_set {
            coefficients.set(assignment)?;
        }
        Ok(Some(coefficients))
    }
}

fn time_scale(value: &str) -> Result<f64, String> {
    match value.parse::<f64>() {
        Ok(k) if k.is_finite() && k > 0.0 => Ok(k),
        _ => Err(format!("`{value}` is not a positive number")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_whole_prefill_sums_its_chunks_and_grows_quadratically() {
        let model = Preset::Llama3_8bH200.coefficients();
        let whole = model.prefill_ms(8192, 0);
        let chunked = model.c0_ms + model.chunk_ms(0, 4096) + model.chunk_ms(4096, 4096);
        assert!((whole - chunked).abs() < 1e-9);
        let attention =
            |n: u32| model.prefill_ms(n, 0) - model.c0_ms - model.k_lin_ms * f64::from(n);
        assert!((attention(8192) / attention(4096) - 4.0).abs() < 1e-9);
        assert!(model.prefill_ms(8192, 4096) < whole / 1.5);
    }

    #[test]
    fn the_reference_decode_step_is_about_26_ms() {
        // fleet.md: H200, Llama-3-8B, 100 requests at 4k context ≈ 4.8 + 16 + 5 ms.
        let step = Preset::Llama3_8bH200
            .coefficients()
            .decode_ms(100 * 4096, 100);
        assert!((24.0..28.0).contains(&step), "{step}");
    }

    #[test]
    fn coefficients_are_changed_by_name_and_bad_ones_are_named() {
        let mut model = Preset::Opt13bA100.coefficients();
        model.set("w_ms=1.5").unwrap();
        model.set("kv_capacity_tokens=1000").unwrap();
        assert_eq!((model.w_ms, model.kv_capacity_tokens), (1.5, 1000));
        assert!(model.set("w_ms=-1").unwrap_err().contains("`w_ms`"));
        assert!(model.set("speed=2").unwrap_err().contains("`speed`"));
        assert!(model
            .set("token_budget=0")
            .unwrap_err()
            .contains("`token_budget`"));
        assert!(model.set("w_ms").unwrap_err().contains("NAME=VALUE"));
    }
}
