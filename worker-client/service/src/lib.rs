//! The process plumbing every pd-bootstrap binary shares, so that each server's lifecycle reads
//! the same and is written once: logging ([`init_logging`]), the shutdown signal
//! ([`shutdown_signal`]), stopping in two steps, not ready first and closed after
//! ([`Draining`], [`drain_on_signal`]), duration flags and error text ([`parse_seconds`], [`error_chain`]),
//! binding and serving an axum router with bounded timeouts and a graceful shutdown
//! ([`serve`], [`bind`], [`Background`]), or on one single-threaded runtime per core
//! ([`serve_on_cores`]), the bearer-token check ([`BearerToken`]), a layer
//! answering the requests a server's own rule refuses ([`GateLayer`]), what a server
//! allocating with mimalloc needs of its process ([`disable_transparent_huge_pages`]), and the
//! check that a shipped dashboard queries only exported metrics ([`check_dashboard`]), and the
//! servers' live pages ([`live_page`]), and their traces over OTLP ([`traces`]), and the
//! pauses of every retry loop ([`backoff`]), and the build a scrape names ([`build_info`]).

pub mod backoff;
mod bearer;
pub mod build_info;
mod connection;
mod cores;
mod draining;
mod gate;
pub mod live_page;
mod logging;
mod memory;
mod metric_names;
#[cfg(feature = "otlp-receiver")]
pub mod otlp_receiver;
mod serve;
mod shutdown;
#[cfg(feature = "test-certs")]
pub mod test_certs;
mod text;
pub mod tls;
pub mod traces;
mod wire_errors;

pub use bearer::BearerToken;
pub use cores::{bind_shared, current_core, serve_on_cores, serving_threads};
pub use draining::{drain_on_signal, Draining};
pub use gate::{Gate, GateLayer, Gated};
pub use logging::{init_logging, LogFormat, Logging};
pub use memory::disable_transparent_huge_pages;
pub use metric_names::check_dashboard;
pub use serve::{bind, serve, Background, BindError, ServeLimits};
pub use shutdown::shutdown_signal;
pub use text::{error_chain, parse_seconds, parse_seconds_or_zero};
pub use tls::{ClientCertified, ServerTls, TlsError, TlsFiles};
pub use wire_errors::{JsonWireErrors, WireErrorBody};
