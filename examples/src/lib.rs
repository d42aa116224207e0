//! Examples of pd-bootstrap: a simulated engine ([`sim`]), the launcher of a local P/D cluster
//! ([`cluster`]), the small OpenAI client they are exercised with ([`openai_client`]), a
//! real DNS server for tests of DNS discovery ([`dnsmasq`]) and a real Prometheus
//! ([`prometheus`]).

pub mod bench;
pub mod cluster;
pub mod cpus;
pub mod dnsmasq;
pub mod openai_client;
pub mod process;
pub mod prometheus;
pub mod sim;
pub mod vllm;
