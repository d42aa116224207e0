//! pd-epp: pd-bootstrap's routing behind a gateway operators already run. It is an Envoy
//! external-processing (ext_proc) server speaking the Gateway API Inference Extension's
//! endpoint picker protocol: Envoy (or Istio, kgateway, any gateway with an InferencePool) asks
//! it where each request goes, and it answers with the placement of the routing core
//! ([`pd_router`]) that pd-proxy also uses: every policy, `precise_prefix` on the engines' KV
//! events, models and LoRA adapters, drain, static, registry and DNS discovery.
//!
//! In a P/D fleet the endpoint is the decode, and the prefill is named for the decode's
//! sidecar (pd-proxy `--sidecar`) in llm-d's `x-prefiller-host-port` header, with its dp rank;
//! in a fleet without prefills it is one engine, picked the same way.
//!
//! A request's path: `service` takes each ext_proc stream, an `exchange` buffers the
//! request's body and asks [`pick`] for its endpoint, answered in the protocol's messages
//! ([`protocol`]). Beside it: [`config`] (flags), [`metrics`], `http` (`/metrics`, `/ready`,
//! the operator routes), `state` (what they share), `server` (the lifecycle).

#![warn(unreachable_pub)]

pub mod config;
mod exchange;
mod http;
pub mod metrics;
pub mod pick;
pub mod protocol;
mod server;
mod service;
mod state;
mod tls;

pub use config::{Args, Config};
pub use server::{Epp, EppError, EppHandle};
