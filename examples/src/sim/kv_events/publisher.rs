//! One dp rank's publisher, as vLLM's `ZmqEventPublisher`: batches go through a bounded queue
//! to a task that sends `[topic, seq, payload]` on the PUB socket and keeps the batch in a ring
//! of `buffer_steps` (numbered when queued, so that a batch dropped at a full queue is a gap
//! subscribers see, as a real engine's PUB socket makes one); another task answers replay
//! requests `[identity, "", start seq]` on the ROUTER socket with every kept batch from there,
//! `[identity, "", topic, seq, payload]`, then the end marker `[identity, "", "", -1, ""]`.
//! Publishing never blocks serving.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use pd_protocol::kv_events::{EventBatch, KvEvent};
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::KvEventsConfig;

/// The batches kept for replay: (sequence number, payload), oldest first.
type Ring = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// The sequence number that ends a replay.
const END_SEQ: i64 = -1;

/// Where a cache hands its events: non-blocking, in order.
#[derive(Clone)]
pub struct Sink {
    queue: mpsc::Sender<(u64, Vec<KvEvent>)>,
    /// The next sequence number, held while a batch is queued so batches queue in order.
    next_seq: Arc<Mutex<u64>>,
    counters: Arc<Counters>,
}

/// Batches published and dropped.
#[derive(Default)]
struct Counters {
    published: AtomicU64,
    dropped: AtomicU64,
}

impl Sink {
    /// Queues a batch of `events` (nothing when there are none); a full queue drops it.
    pub fn publish(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let mut seq = self.next_seq.lock().unwrap_or_else(|e| e.into_inner());
        if self.queue.try_send((*seq, events)).is_err() {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
        }
        *seq += 1;
    }
}

/// A running publisher: its tasks end when every [`Sink`] is gone (the queue closes).
pub struct Publisher {
    /// The rank's config as subscribers reach it: endpoints offset and bound.
    pub config: KvEventsConfig,
    sink: Sink,
}

impl Publisher {
    /// Binds rank `rank`'s sockets (`config` already offset for it) and starts its tasks.
    pub async fn start(config: KvEventsConfig, host: IpAddr, rank: u32) -> Result<Self, String> {
        let mut config = config;
        let mut publisher = PubSocket::new();
        config.endpoint = bind(&mut publisher, &config.endpoint, host, false).await?;
        let ring: Ring = Arc::default();
        if let Some(endpoint) = config.replay_endpoint.take() {
            let mut router = RouterSocket::new();
            config.replay_endpoint = Some(bind(&mut router, &endpoint, host, true).await?);
            let topic = Bytes::from(config.topic.clone());
            tokio::spawn(replay(router, ring.clone(), topic));
        }
        let (queue, batches) = mpsc::channel(config.max_queue_size);
        let counters = Arc::new(Counters::default());
        let sending = Sending {
            socket: publisher,
            topic: Bytes::from(config.topic.clone()),
            ring,
            keep: config.buffer_steps,
            rank,
            counters: counters.clone(),
        };
        tokio::spawn(sending.run(batches));
        let sink = Sink {
            queue,
            next_seq: Arc::default(),
            counters,
        };
        Ok(Publisher { config, sink })
    }

    /// Where the rank's cache hands its events.
    pub fn sink(&self) -> Sink {
        self.sink.clone()
    }

    /// Batches sent on the PUB socket.
    pub fn published(&self) -> u64 {
        self.sink.counters.published.load(Ordering::Relaxed)
    }

    /// Batches dropped at a full queue.
    pub fn dropped(&self) -> u64 {
        self.sink.counters.dropped.load(Ordering::Relaxed)
    }
}

/// Binds `endpoint` as vLLM binds it, returning the endpoint as subscribers reach it: a
/// wildcard with port 0 binds a free port on `host` (vLLM: on the node's address). Only
/// `tcp://` is simulated; a PUB endpoint must be a wildcard (vLLM connects to any other),
/// `any_host` (the replay socket) binds any address given.
async fn bind<S: Socket>(
    socket: &mut S,
    endpoint: &str,
    host: IpAddr,
    any_host: bool,
) -> Result<String, String> {
    let invalid = |why: &str| format!("--kv-events-config: endpoint {endpoint}: {why}");
    let (address, port) = endpoint
        .strip_prefix("tcp://")
        .and_then(|a| a.rsplit_once(':'))
        .ok_or_else(|| invalid("the simulator binds tcp://host:port endpoints only"))?;
    let wildcard = matches!(address, "*" | "0.0.0.0" | "::" | "[::]");
    if !wildcard && !any_host {
        return Err(invalid(
            "vLLM connects a PUB socket to a non-wildcard endpoint; the simulator binds (tcp://*:port)",
        ));
    }
    let at = match (address, port) {
        (_, "0") if wildcard => std::net::SocketAddr::new(host, 0).to_string(),
        ("*", port) => format!("0.0.0.0:{port}"),
        ("::", port) => format!("[::]:{port}"),
        (address, port) => format!("{address}:{port}"),
    };
    let local = socket
        .bind(&format!("tcp://{at}"))
        .await
        .map_err(|err| invalid(&err.to_string()))?;
    Ok(match port {
        "0" => local.to_string(),
        _ => endpoint.to_owned(),
    })
}

/// The PUB side: sends each queued batch and keeps it for replay.
struct Sending {
    socket: PubSocket,
    topic: Bytes,
    ring: Ring,
    keep: usize,
    rank: u32,
    counters: Arc<Counters>,
}

impl Sending {
    async fn run(mut self, mut batches: mpsc::Receiver<(u64, Vec<KvEvent>)>) {
        while let Some((seq, events)) = batches.recv().await {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let batch = EventBatch {
                ts,
                events,
                data_parallel_rank: Some(self.rank),
            };
            let payload = Bytes::from(batch.encode());
            let message = frames(vec![
                self.topic.clone(),
                seq_frame(seq as i64),
                payload.clone(),
            ]);
            if let Err(err) = self.socket.send(message).await {
                tracing::warn!(seq, "KV events: a batch was not published: {err}");
            }
            self.counters.published.fetch_add(1, Ordering::Relaxed);
            if self.keep > 0 {
                let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
                if ring.len() == self.keep {
                    ring.pop_front();
                }
                ring.push_back((seq, payload));
            }
        }
    }
}

fn seq_frame(seq: i64) -> Bytes {
    Bytes::copy_from_slice(&seq.to_be_bytes())
}

fn frames(frames: Vec<Bytes>) -> ZmqMessage {
    frames.try_into().expect("a message has frames")
}

/// The ROUTER side: answers each replay request from the ring.
async fn replay(mut router: RouterSocket, ring: Ring, topic: Bytes) {
    loop {
        let request = match router.recv().await {
            Ok(request) => request.into_vec(),
            Err(err) => {
                tracing::warn!("KV events: the replay socket failed: {err}");
                return;
            }
        };
        let [identity, _, start] = &request[..] else {
            tracing::warn!(
                frames = request.len(),
                "KV events: an invalid replay request"
            );
            continue;
        };
        // vLLM reads the start as an unsigned big-endian integer of any length.
        let start = start.iter().fold(0u128, |n, b| n << 8 | u128::from(*b));
        let kept: Vec<(u64, Bytes)> = {
            let ring = ring.lock().unwrap_or_else(|e| e.into_inner());
            ring.iter()
                .filter(|(seq, _)| u128::from(*seq) >= start)
                .cloned()
                .collect()
        };
        let head = [identity.clone(), Bytes::new()];
        let replies = kept
            .into_iter()
            .map(|(seq, payload)| [topic.clone(), seq_frame(seq as i64), payload])
            .chain([[Bytes::new(), seq_frame(END_SEQ), Bytes::new()]]);
        for reply in replies {
            let message = frames([&head[..], &reply[..]].concat());
            if let Err(err) = router.send(message).await {
                tracing::debug!("KV events: a replay answer was not sent: {err}");
                break;
            }
        }
    }
}
