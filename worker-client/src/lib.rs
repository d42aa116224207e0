//! The worker side of pd-bootstrap: what P and D workers (and operators) use to talk to a
//! bootstrap server. The wire types are [`protocol`] (the `pd-protocol` crate); the KV data plane
//! is the separate `pd-transfer` crate.
//!
//! - [`BootstrapClient`]: one server; P-side registration with bounded retries, request ids,
//!   topology and readiness.
//! - [`LeaseKeeper`] ([`BootstrapClient::register_leased`]): a registration kept alive by a
//!   background task, gone from the registry when the worker is.
//! - [`BootstrapClient::watch`]: the registry's worker changes as a stream of [`WatchUpdate`]s.
//! - SGLang's dialect ([`BootstrapClient::register_route`], [`BootstrapClient::sglang_rank`],
//!   the bootstrap-room calls): what SGLang prefill ranks and decodes send.
//! - [`EngineDirectory`]: D side; where a remote engine's workers are, cached per bootstrap
//!   address with shared (single-flight) lookups.
//! - [`ClientTls`]: a private CA and a client certificate, for `https://` servers.
//! - [`protocol`]: the JSON of every route, one module per dialect.
//!
//! Nothing here waits without a bound: every attempt has a timeout and every retry loop a
//! deadline; errors say what failed, where, and whether retrying can help
//! ([`ClientError::is_retryable`]).

mod client;
mod directory;
mod error;
mod lease;
mod retry;
mod sglang;
mod tls;
mod watch;

pub use pd_protocol as protocol;

pub use client::{BootstrapClient, BootstrapClientBuilder, RequestOutcome};
pub use directory::{EngineDirectory, EngineInfo};
pub use error::ClientError;
pub use lease::{LeaseKeeper, LeaseState};
pub use retry::RetryPolicy;
pub use sglang::PrefillRank;
pub use tls::ClientTls;
pub use watch::WatchUpdate;
