//! `sim-engine`: a stand-in for a vLLM engine with the Mooncake connector or an SGLang engine in
//! P/D mode. Everything around the model is real (registration, lookups, KV transfers over the
//! transfer listeners, the OpenAI API and SGLang's `/generate`, the prompt's token ids, the
//! prefix cache's KV cache events); the model is a timer and a deterministic byte stream.

pub mod api;
pub mod config;
pub mod engine;
pub mod failure;
pub mod kv;
pub mod kv_events;
pub mod lora;
pub mod model;
pub mod pace;
pub mod prefix_cache;
pub mod scheduler;
pub mod tls;
pub mod tokens;

pub use config::{Dialect, Role, SimArgs};
pub use engine::{SimEngine, SimError};
