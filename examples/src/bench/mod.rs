//! The benchmark suite: a closed-loop load generator, the scenarios (control plane, proxy, KV
//! data plane, public traces on a fleet), and the Markdown report.

pub mod bootstrap;
pub mod bootstrap_scale;
pub mod chart;
pub mod epp;
pub mod fleet;
pub mod kv_index;
pub mod loadgen;
pub mod migration;
pub mod mock_events;
pub mod mocks;
pub mod output;
pub mod overload;
pub mod proxy;
pub mod proxy_scale;
pub mod real_vllm;
pub mod report;
pub mod routing;
pub mod security;
pub mod sglang;
pub mod suite;
pub mod tokenize;
pub mod transfer;
pub mod watch;
