//! The pd-bootstrap registry server: a durable, vLLM Mooncake-compatible HTTP registry of
//! prefill workers and request ids.
//!
//! The pieces, from the wire inwards: [`http`] (routes and layers), [`registry`] (the one type
//! that validates and applies every change), [`store`] (durability behind a trait; sled by
//! default), plus [`metrics`], [`config`] (the binary's flags) and [`server`] (the lifecycle).

pub mod config;
pub mod http;
pub mod metrics;
pub mod registry;
pub mod server;
pub mod store;
mod sync;

pub use server::{Server, ServerConfig, ServerError};
