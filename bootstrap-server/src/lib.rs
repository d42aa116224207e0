//! The pd-bootstrap registry server: a durable, vLLM Mooncake-compatible HTTP registry of
//! prefill workers and request ids.
//!
//! The pieces, from the wire inwards:
//! - [`http`]: the layers every route shares and one module per wire dialect
//!   ([`http::vllm`], [`http::native`]) that maps its JSON to registry calls and renders the
//!   answers and errors in its clients' words. A new dialect is one more module here.
//! - [`registry`]: the domain ([`registry::model`]: slots, registrations, leases, request ids,
//!   changes): validates and plans every change, commits it through the store, and follows the
//!   store's events (its own, other replicas', expired leases) in revision order. No HTTP, no
//!   dialect wording.
//! - [`store`]: durability behind one trait, one folder per backend ([`store::SledStore`] by
//!   default, [`store::EtcdStore`] for replicas). A new backend is one more folder.
//! - [`metrics`], [`config`] (the binary's flags) and [`server`] (bind, serve, prune, shut
//!   down; the serving itself is `pd_service`'s, shared with the proxy); [`instances`]: further
//!   registries of the same process, each with its own store and port.
//!
//! A registration's path: `POST /register` -> [`http::vllm`] parses the body into a
//! [`registry::model::Registration`] -> [`registry::Registry::register`] validates it, plans a
//! [`registry::model::WorkerChange`] against the table and commits it with
//! [`store::Store::commit_workers`] -> the store makes it durable and reports it as an event ->
//! the registry applies the event to its table and history, and the 200 goes out.

pub mod config;
pub mod http;
pub mod instances;
pub mod metrics;
pub mod registry;
pub mod server;
pub mod store;
mod sync;

pub use server::{Server, ServerConfig, ServerError, ServerHandle};
