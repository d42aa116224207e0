//! KV cache events as vLLM publishes them (`--kv-events-config`, vLLM's
//! `vllm/distributed/kv_events.py`): each dp rank's prefix cache publishes its changes on a ZMQ
//! PUB socket (frames: topic, 8-byte big-endian sequence number, msgpack batch) and answers
//! replay requests on a ROUTER socket from a ring of its last `buffer_steps` batches; the
//! endpoints' ports are offset by the dp rank, as vLLM offsets them. The config of each rank,
//! endpoints resolved, is what `GET /kv_event_sources` answers.

mod batch;
mod publisher;

pub use batch::{Batch, StoredBlock};
pub use publisher::{Publisher, Sink};
use serde::{Deserialize, Serialize};

/// vLLM's `KVEventsConfig`, as `--kv-events-config` takes it and `/kv_event_sources` answers it
/// (unknown fields refused, as vLLM refuses them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvEventsConfig {
    /// Whether events are published at all.
    #[serde(default)]
    pub enable_kv_cache_events: bool,
    /// `zmq` or `null` (default: `zmq` when enabled, else `null`).
    #[serde(default)]
    pub publisher: Option<String>,
    /// The PUB socket's endpoint (`tcp://*:0`: a free port on `--host`).
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    /// The ROUTER socket answering replay requests, if any.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
    /// vLLM's ZMQ high-water mark (reported; the simulator's PUB drops for slow subscribers
    /// at its own bound).
    #[serde(default = "default_bound")]
    pub hwm: usize,
    /// Batches queued for the publisher; past it batches are dropped (a gap subscribers see).
    #[serde(default = "default_bound")]
    pub max_queue_size: usize,
    /// The topic of every message.
    #[serde(default)]
    pub topic: String,
}

fn default_endpoint() -> String {
    "tcp://*:5557".into()
}

fn default_buffer_steps() -> usize {
    10_000
}

/// vLLM's default `hwm` and `max_queue_size`.
fn default_bound() -> usize {
    100_000
}

impl KvEventsConfig {
    /// Reads the flag's JSON, the publisher resolved as vLLM resolves it.
    pub fn parse(json: &str) -> Result<Self, String> {
        let mut config: KvEventsConfig =
            serde_json::from_str(json).map_err(|err| format!("--kv-events-config: {err}"))?;
        let publisher = match config.enable_kv_cache_events {
            true => "zmq",
            false => "null",
        };
        let publisher = config.publisher.get_or_insert_with(|| publisher.into());
        if publisher != "zmq" && publisher != "null" {
            return Err(format!(
                "--kv-events-config: unknown event publisher '{publisher}'"
            ));
        }
        if config.max_queue_size == 0 {
            return Err("--kv-events-config: max_queue_size must be at least 1".into());
        }
        Ok(config)
    }

    /// Whether a publisher runs (enabled, with the `zmq` publisher).
    pub fn enabled(&self) -> bool {
        self.enable_kv_cache_events && self.publisher.as_deref() == Some("zmq")
    }

    /// The config of dp rank `rank`: its endpoints' ports offset by the rank.
    pub fn for_rank(&self, rank: u32) -> Self {
        KvEventsConfig {
            endpoint: offset_endpoint_port(&self.endpoint, rank),
            replay_endpoint: self
                .replay_endpoint
                .as_deref()
                .map(|e| offset_endpoint_port(e, rank)),
            ..self.clone()
        }
    }
}

/// vLLM's `offset_endpoint_port`: a tcp endpoint's port plus the dp rank (a port of 0 stays 0,
/// for the system to pick), an `inproc` endpoint suffixed `_dp<rank>`.
pub fn offset_endpoint_port(endpoint: &str, rank: u32) -> String {
    if rank == 0 {
        return endpoint.to_owned();
    }
    if endpoint.contains("inproc") {
        return format!("{endpoint}_dp{rank}");
    }
    match endpoint
        .rsplit_once(':')
        .map(|(a, p)| (a, p.parse::<u32>()))
    {
        Some((address, Ok(port))) if port != 0 => format!("{address}:{}", port + rank),
        _ => endpoint.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_reads_as_vllm_s() {
        let config = KvEventsConfig::parse(r#"{"enable_kv_cache_events": true}"#).unwrap();
        assert_eq!(config.publisher.as_deref(), Some("zmq"));
        assert_eq!(
            (config.endpoint.as_str(), config.buffer_steps),
            ("tcp://*:5557", 10_000)
        );
        assert!(config.enabled());
        let off = KvEventsConfig::parse("{}").unwrap();
        assert_eq!(
            (off.publisher.as_deref(), off.enabled()),
            (Some("null"), false)
        );
        assert!(KvEventsConfig::parse(r#"{"publisher": "kafka"}"#).is_err());
        assert!(KvEventsConfig::parse(r#"{"endpoints": "x"}"#)
            .unwrap_err()
            .contains("endpoints"));
    }

    #[test]
    fn ports_are_offset_by_the_dp_rank() {
        let config = KvEventsConfig {
            replay_endpoint: Some("tcp://*:5600".into()),
            ..KvEventsConfig::parse(r#"{"enable_kv_cache_events": true}"#).unwrap()
        };
        let rank2 = config.for_rank(2);
        assert_eq!(rank2.endpoint, "tcp://*:5559");
        assert_eq!(rank2.replay_endpoint.as_deref(), Some("tcp://*:5602"));
        assert_eq!(config.for_rank(0), config);
        assert_eq!(offset_endpoint_port("tcp://*:0", 3), "tcp://*:0");
        assert_eq!(
            offset_endpoint_port("inproc://cache", 1),
            "inproc://cache_dp1"
        );
        assert_eq!(offset_endpoint_port("tcp://[::1]:7", 1), "tcp://[::1]:8");
    }
}
