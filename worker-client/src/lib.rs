//! The worker side of pd-bootstrap: what P and D workers (and operators) use to talk to a
//! bootstrap server, and the wire types every part of the project shares.
//!
//! - [`BootstrapClient`]: one server; P-side registration with bounded retries, request ids,
//!   topology and readiness.
//! - [`LeaseKeeper`] ([`BootstrapClient::register_leased`]): a registration kept alive by a
//!   background task, gone from the registry when the worker is.
//! - [`BootstrapClient::watch`]: the registry's worker changes as a stream of [`WatchUpdate`]s.
//! - [`EngineDirectory`]: D side; where a remote engine's workers are, cached per bootstrap
//!   address with shared (single-flight) lookups.
//! - [`protocol`]: the JSON of every route.
//! - [`transfer`]: the KV data plane (P exports, D pulls) over TCP, or UCX with the `ucx` feature.
//! - [`service`] and [`serve`]: logging, shutdown and HTTP serving for the project's binaries.
//!
//! Nothing here waits without a bound: every attempt has a timeout and every retry loop a
//! deadline; errors say what failed, where, and whether retrying can help
//! ([`ClientError::is_retryable`]).

mod client;
mod directory;
mod error;
mod lease;
pub mod protocol;
mod retry;
pub mod serve;
pub mod service;
pub mod transfer;
mod watch;

pub use client::{BootstrapClient, BootstrapClientBuilder, RequestOutcome};
pub use directory::{EngineDirectory, EngineInfo};
pub use error::ClientError;
pub use lease::{LeaseKeeper, LeaseState};
pub use retry::RetryPolicy;
pub use watch::WatchUpdate;
