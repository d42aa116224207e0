//! pd-proxy: the OpenAI-compatible front door of prefill/decode (P/D) disaggregated serving.
//!
//! Each completion request goes to a prefill server (P) and a decode server (D) at the same time;
//! D pulls the KV cache P computes and streams the answer, which the proxy relays to the client.
//!
//! A request's path, outside in: [`server`] accepts it (`pd_service::serve`); [`routes`] hands
//! it to the [`layers`] (its `X-Request-Id`, its tracker for the metrics, the `--api-key` check),
//! then to [`handler`], which runs the [`flow`]: the [`routing`] policies choose a (prefill, dp
//! rank) pair and a decode from the [`backend`] pool, [`body`] makes P's and D's bodies, the
//! flow calls both through [`upstream`] (concurrently, or P first), retries D once elsewhere,
//! and [`relay`] streams D's answer back while P is still watched. Failures become OpenAI-shaped
//! errors ([`error`]).
//!
//! Beside the request path: [`config`] (flags into a [`Config`]), [`discovery`] (each P's dp
//! ranks and engine ids from its bootstrap server, followed through its watch), [`health`]
//! (active checks), [`metrics`], [`models`] (`/v1/models`), [`state`] (what handlers share),
//! [`ids`], [`endpoint`].

pub mod admin;
pub mod config;
pub mod error;
pub mod flow;
pub mod handler;
pub mod ids;
pub mod intake;
pub mod layers;
pub mod metrics;
pub mod models;
pub mod readiness;
pub mod relay;
pub mod routes;
pub mod server;
pub mod state;
pub mod trace;
pub mod ui;
pub mod upstream;

pub use config::Config;
pub use server::{Proxy, ProxyError, ProxyHandle};
