//! pd-proxy: the OpenAI-compatible front door of prefill/decode (P/D) disaggregated serving.
//! Each completion request goes to a prefill server (P) and a decode server (D) at the same
//! time; D pulls the KV cache P computes and streams the answer, which the proxy relays.
//!
//! Where each request goes is the routing core's ([`pd_router`]: the fleet and the placement);
//! this crate is the HTTP front door around it, as a stack:
//!
//! - `server` binds, starts the router's fleet and serves; `routes` is the router of
//!   paths: the proxied routes behind the `layers` (request id, tracker, the tenant of the
//!   request's key and its limits: `rate_limits`), and
//!   `/health`, `/ready` (`readiness`), `/metrics` (`metrics`), `/v1/models`
//!   (`model_list`), `/admin/*` (`admin`) and the live page (`ui`);
//! - `handler` runs a request's `flow`, in named stages: intake (the body read under the
//!   client limits of `intake`, parsed, its model found), placement (the router's), dispatch
//!   (P and D called through `upstream`, one file per mode), then `relay` streams D's
//!   answer back while P is still watched;
//! - failures become OpenAI-shaped errors (`error`); `trace` follows a request over OTLP;
//!   `ids` makes request and transfer ids; `state` is the wiring the handlers share.
//!
//! Its public API is the configuration ([`config`], [`Config`]) and the server ([`Proxy`],
//! [`ProxyHandle`]); everything else is the crate's own.

#![warn(unreachable_pub)]

mod admin;
pub mod config;
mod error;
mod flow;
mod handler;
mod ids;
mod intake;
mod layers;
mod metrics;
mod model_list;
mod models;
mod rate_limits;
mod readiness;
mod relay;
mod route;
mod routes;
mod server;
mod state;
mod trace;
mod ui;
mod upstream;

pub use config::Config;
pub use server::{Proxy, ProxyError, ProxyHandle};
