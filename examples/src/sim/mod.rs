//! `sim-engine`: a stand-in for a vLLM engine with the Mooncake connector. Everything around the
//! model is real (registration, lookups, KV transfers over the transfer listeners, OpenAI API);
//! the model is a timer and a deterministic byte stream.

pub mod config;
pub mod engine;
pub mod kv;
pub mod openai;

pub use config::{Role, SimArgs};
pub use engine::{SimEngine, SimError};
