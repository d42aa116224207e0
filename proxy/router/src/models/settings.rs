//! The models' flags (`--lora-load-on-demand`, `--lora-load-timeout`) and what the `--config`
//! file adds: aliases, per-model policies, the adapters the proxy may load.

use std::collections::HashMap;
use std::time::Duration;

use clap::Args;
use pd_service::parse_seconds;

use crate::routing::settings::Policy;

/// The models' flags.
#[derive(Debug, Clone, Args)]
pub struct ModelsArgs {
    /// A request for a LoRA adapter that no ready (prefill, decode) pair has loaded may have it
    /// loaded on engines of its base model (vLLM's `POST /v1/load_lora_adapter`; the engines
    /// must run with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`). The adapter's path comes from
    /// the `--config` file's `[adapters]`, else from an engine that lists it.
    #[arg(long, env = "PD_PROXY_LORA_LOAD_ON_DEMAND")]
    pub lora_load_on_demand: bool,
    /// The longest one adapter load may take (within the request's own timeout).
    #[arg(long, env = "PD_PROXY_LORA_LOAD_TIMEOUT", default_value = "30", value_parser = parse_seconds)]
    pub lora_load_timeout: Duration,
}

/// Where an adapter can be loaded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterSource {
    /// The base model it runs on.
    pub base: String,
    /// Its path (or name) as the engines load it (`lora_path`).
    pub path: String,
}

/// The policies of one model's requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPolicies {
    /// How its (prefill, dp rank) pairs are chosen.
    pub prefill: Policy,
    /// How its decodes are chosen.
    pub decode: Policy,
}

/// What the proxy knows of models besides what the engines list.
#[derive(Debug, Clone, Default)]
pub struct ModelsConfig {
    /// Alias -> the model requests for it go to (and name in their body).
    pub aliases: HashMap<String, String>,
    /// Models whose requests use other policies than the flags'.
    pub policies: HashMap<String, ModelPolicies>,
    /// Adapters the proxy may load, by name.
    pub adapters: HashMap<String, AdapterSource>,
    /// Whether adapters may be loaded where they are missing (`--lora-load-on-demand`).
    pub load_on_demand: bool,
    /// The longest one load may take.
    pub load_timeout: Duration,
}

impl ModelsConfig {
    /// The model `name` stands for (itself unless it is an alias).
    pub fn canonical<'a>(&'a self, name: &'a str) -> &'a str {
        self.aliases.get(name).map_or(name, String::as_str)
    }

    /// Whether the configuration names `model` (as a model with policies, an alias's target,
    /// an adapter or an adapter's base).
    pub fn names(&self, model: &str) -> bool {
        self.policies.contains_key(model)
            || self.aliases.values().any(|target| target == model)
            || self
                .adapters
                .iter()
                .any(|(name, source)| name == model || source.base == model)
    }
}
