//! The KV data plane over UCX (cargo feature `ucx`): P exposes KV in UCX-allocated memory, D
//! pulls it one-sidedly with `ucp_get_nbx`.
//!
//! - [`UcxExporter`] (P): a pool of UCX-allocated blocks ([`BlockPool`]); `publish` copies a
//!   transfer's KV into free blocks, and `GET /kv/{id}?wait_ms=N` on its listener
//!   (`ucx://host:port`) answers with a [`KvDescriptor`] (worker address, packed remote key,
//!   region base, block runs) once the KV is published. The blocks stay reserved until D sends
//!   `DELETE /kv/{id}` or the hold time passes. A progress thread owns P's worker.
//! - [`UcxPuller`] (D): fetches the descriptor, then an engine thread that owns D's worker
//!   connects (one cached [`Endpoint`] per P worker address), unpacks the key and pulls the
//!   blocks in chunks, several gets in flight, until done or the deadline.
//!
//! The safe wrappers ([`Context`], [`MemRegion`], [`Worker`], [`Endpoint`], [`RemoteKey`],
//! [`Request`]) own one UCX object each and free it on drop, in the order UCX requires.

mod context;
mod descriptor;
mod engine;
mod exporter;
mod pool;
mod puller;
mod status;
mod worker;

pub use context::{Context, MemRegion};
pub use descriptor::{Chunk, KvDescriptor};
pub use engine::PullConfig;
pub use exporter::UcxExporter;
pub use pool::{BlockPool, BlockRange, Lease};
pub use puller::UcxPuller;
pub use status::UcxError;
pub use worker::{Endpoint, RemoteKey, Request, Worker};
