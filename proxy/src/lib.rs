//! pd-proxy: the OpenAI-compatible front door of prefill/decode (P/D) disaggregated vLLM serving
//! with the Mooncake connector.
//!
//! Each completion request goes to a prefill server (P) and a decode server (D) at the same time;
//! D pulls the KV cache P computes and streams the answer, which the proxy relays to the client.
//!
//! The pieces: [`config`] (flags into a [`Config`]), [`backend`] (what is known about each P and D:
//! health, load, discovered dp ranks), [`discovery`] (learning each P's engine ids from its
//! bootstrap server), [`health`] (active health checks), [`policy`] (choosing backends), [`body`]
//! (what P and D receive), [`upstream`] (calling them), [`relay`] (streaming D's answer back),
//! [`handler`] (the per-request flow), [`error`] (what clients see when it fails), [`metrics`] and
//! [`server`] (routes and lifecycle).

pub mod backend;
pub mod body;
pub mod config;
pub mod discovery;
pub mod error;
pub mod handler;
pub mod health;
pub mod metrics;
pub mod policy;
pub mod relay;
pub mod server;
pub mod upstream;

pub use config::Config;
pub use server::{Proxy, ProxyError, ProxyHandle};
