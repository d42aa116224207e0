//! A stand-in for an engine's KV-event publisher, speaking vLLM 0.32's wire: a PUB socket
//! sending `[topic, seq (8 bytes, big-endian), payload]`, and (optionally) a ROUTER replay
//! socket answering `[identity, "", start]` with `[identity, "", topic, seq, payload]` per
//! buffered batch from `start` on, then `[identity, "", "", -1, ""]`.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use pd_protocol::kv_events::{BlockHash, BlockRemoved, BlockStored, EventBatch, KvEvent};
use serde_json::{json, Value};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The topic every test publisher uses.
pub const TOPIC: &str = "kv";

/// A publisher and the batches it sent (what its replay socket serves).
pub struct Publisher {
    socket: PubSocket,
    /// `tcp://127.0.0.1:PORT` of the PUB socket.
    pub endpoint: String,
    /// The replay socket's endpoint, if it has one.
    pub replay: Option<String>,
    sent: Arc<Mutex<Vec<(u64, Bytes)>>>,
    replay_task: Option<tokio::task::JoinHandle<()>>,
}

impl Publisher {
    /// Binds on 127.0.0.1 (and a replay socket when `with_replay`).
    pub async fn start(with_replay: bool) -> Self {
        let mut socket = PubSocket::new();
        let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let sent = Arc::new(Mutex::new(Vec::new()));
        let (replay, replay_task) = if with_replay {
            let mut router = RouterSocket::new();
            let replay = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
            let task = tokio::spawn(serve_replay(router, sent.clone()));
            (Some(replay), Some(task))
        } else {
            (None, None)
        };
        Publisher {
            socket,
            endpoint,
            replay,
            sent,
            replay_task,
        }
    }

    /// What vLLM's `GET /kv_event_sources` answers for this publisher (dp rank 0, the wildcard
    /// host, as vLLM reports it).
    pub fn sources(&self) -> Value {
        let wildcard = |endpoint: &str| endpoint.replace("127.0.0.1", "*");
        json!({"0": {"enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": wildcard(&self.endpoint),
            "replay_endpoint": self.replay.as_deref().map(wildcard),
            "topic": TOPIC, "buffer_steps": 10000, "hwm": 100000}})
    }

    /// Publishes `events` as batch `seq`; `delivered` false keeps it for replay only (a batch
    /// the subscriber missed).
    pub async fn publish(&mut self, seq: u64, events: Vec<KvEvent>, delivered: bool) {
        let payload = Bytes::from(
            EventBatch {
                ts: 1.0,
                events,
                data_parallel_rank: Some(0),
            }
            .encode(),
        );
        self.sent.lock().unwrap().push((seq, payload.clone()));
        if delivered {
            let message: ZmqMessage = vec![
                Bytes::from_static(TOPIC.as_bytes()),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ]
            .try_into()
            .unwrap();
            self.socket.send(message).await.unwrap();
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Some(task) = &self.replay_task {
            task.abort();
        }
    }
}

async fn serve_replay(mut router: RouterSocket, sent: Arc<Mutex<Vec<(u64, Bytes)>>>) {
    while let Ok(request) = router.recv().await {
        let frames = request.into_vec();
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let start = u64::from_be_bytes(start[..].try_into().unwrap_or([0xff; 8]));
        let batches: Vec<(u64, Bytes)> = sent
            .lock()
            .unwrap()
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        let end = (
            Bytes::new(),
            Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
            Bytes::new(),
        );
        let replies = batches
            .into_iter()
            .map(|(seq, payload)| {
                (
                    Bytes::from_static(TOPIC.as_bytes()),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                )
            })
            .chain(std::iter::once(end));
        for (topic, seq, payload) in replies {
            let reply: ZmqMessage = vec![identity.clone(), Bytes::new(), topic, seq, payload]
                .try_into()
                .unwrap();
            if router.send(reply).await.is_err() {
                break;
            }
        }
    }
}

/// `BlockStored` of `blocks` blocks of 4 tokens from `first_token` on, hashed `first_hash`..,
/// chained to `parent`.
pub fn stored(first_hash: i128, blocks: usize, parent: Option<i128>, first_token: u32) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: (0..blocks as i128)
            .map(|i| BlockHash::Int(first_hash + i))
            .collect(),
        parent_block_hash: parent.map(BlockHash::Int),
        token_ids: (first_token..first_token + 4 * blocks as u32).collect(),
        block_size: 4,
        medium: Some("GPU".into()),
        ..BlockStored::default()
    })
}

/// `BlockRemoved` of `hashes`.
pub fn removed(hashes: &[i128]) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|h| BlockHash::Int(*h)).collect(),
        medium: Some("GPU".into()),
        group_idx: None,
        ..BlockRemoved::default()
    })
}

/// `BlockStored` of `tokens` cut into blocks of `block_size`, hashed `first_hash`.., the first
/// chained to `parent`.
pub fn stored_tokens(
    first_hash: i128,
    tokens: &[u32],
    block_size: usize,
    parent: Option<i128>,
) -> KvEvent {
    let blocks = tokens.len() / block_size;
    KvEvent::BlockStored(BlockStored {
        block_hashes: (0..blocks as i128)
            .map(|i| BlockHash::Int(first_hash + i))
            .collect(),
        parent_block_hash: parent.map(BlockHash::Int),
        token_ids: tokens[..blocks * block_size].to_vec(),
        block_size: block_size as u32,
        medium: Some("GPU".into()),
        ..BlockStored::default()
    })
}
