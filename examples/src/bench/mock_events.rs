//! KV cache events for the instant mocks: a ZMQ publisher announcing, as vLLM does, that the
//! mock P holds the blocks of the benchmark's prompt, so that a proxy routing on the engines'
//! events (pd-proxy's precise_prefix) does its whole work (tokenize, match) on every request.
//! The announcement is repeated every 200 ms, so a subscriber that joins late still sees it.

use std::time::Duration;

use bytes::Bytes;
use pd_protocol::kv_events::{BlockHash, BlockStored, EventBatch, KvEvent};
use serde_json::{json, Value};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

/// Tokens per announced block.
const BLOCK: usize = 16;

/// A running publisher: what the mock's `GET /kv_event_sources` answers.
pub struct MockEvents {
    /// vLLM's publisher config of dp rank 0, by rank.
    pub sources: Value,
}

/// Binds a PUB socket on 127.0.0.1 and announces the whole blocks of `tokens`, forever.
pub async fn announce(tokens: Vec<u32>) -> MockEvents {
    let mut socket = PubSocket::new();
    let endpoint = socket
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("bind the mock's KV event publisher")
        .to_string();
    let blocks = tokens.len() / BLOCK;
    let event = KvEvent::BlockStored(BlockStored {
        block_hashes: (0..blocks as i128).map(BlockHash::Int).collect(),
        parent_block_hash: None,
        token_ids: tokens[..blocks * BLOCK].to_vec(),
        block_size: BLOCK as u32,
        medium: Some("GPU".into()),
        ..BlockStored::default()
    });
    let payload = Bytes::from(
        EventBatch {
            ts: 0.0,
            events: vec![event],
            data_parallel_rank: Some(0),
        }
        .encode(),
    );
    tokio::spawn(async move {
        for seq in 0u64.. {
            let mut message = ZmqMessage::from(Bytes::from_static(b"kv"));
            message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
            message.push_back(payload.clone());
            if socket.send(message).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    MockEvents {
        sources: json!({"0": {"enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": endpoint, "replay_endpoint": null, "topic": "kv"}}),
    }
}
