//! One engine's event stream: a ZMQ SUB socket on its publisher, every batch applied to the
//! index in sequence order. The 8-byte sequence number of each message is checked: a batch
//! missing in between (a gap: the PUB socket drops when the subscriber is slow, or the link
//! broke) is fetched from the engine's replay socket when it has one; when it has none, or the
//! replay cannot fill the gap, the engine's entries are dropped and rebuilt from the events
//! that follow (never trusted half-known). A sequence that starts again lower is a restarted
//! engine: its entries are dropped too. The first subscription (this process just started:
//! the index knows nothing of the engine) first replays everything the engine still keeps
//! (vLLM keeps its last 10,000 batches), so a restarted proxy routes on the engines' caches
//! again within moments rather than as they happen to change.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::sources::Source;
use super::{EngineSlot, KvTracker};

/// How long a connection or a whole replay may take.
const ZMQ_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest wait between two attempts to subscribe.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// The most batches one replay may bring (vLLM keeps 10,000 by default).
const MAX_REPLAY: usize = 100_000;

/// How long the first replay (every batch the engine keeps) may take.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(10);

/// What one message said.
struct Message {
    seq: u64,
    payload: Bytes,
}

/// A message's frames: `[topic, seq, payload]` (a replayed one after the empty delimiter). A
/// sequence of -1 (all ones) ends a replay: `None`.
fn message(frames: &[Bytes]) -> Result<Option<Message>, String> {
    let [.., seq, payload] = frames else {
        return Err(format!("{} frames, not 3", frames.len()));
    };
    let seq: [u8; 8] = seq[..]
        .try_into()
        .map_err(|_| format!("a sequence number of {} bytes", seq.len()))?;
    let seq = i64::from_be_bytes(seq);
    Ok(u64::try_from(seq).ok().map(|seq| Message {
        seq,
        payload: payload.clone(),
    }))
}

/// Follows `source` for `slot` until the task is aborted, resubscribing after failures with
/// a bounded backoff.
pub async fn follow(tracker: Arc<KvTracker>, slot: EngineSlot, source: Source) {
    let mut backoff = Duration::from_millis(100);
    let mut first = true;
    loop {
        match subscribe(&source).await {
            Ok(socket) => {
                backoff = Duration::from_millis(100);
                tracker.feed(slot).connected(true);
                stream(&tracker, slot, &source, socket, std::mem::take(&mut first)).await;
                tracker.feed(slot).connected(false);
            }
            Err(err) => {
                tracing::debug!(endpoint = %source.endpoint, "KV events: cannot subscribe: {err}");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

async fn subscribe(source: &Source) -> Result<SubSocket, String> {
    let mut socket = SubSocket::new();
    tokio::time::timeout(ZMQ_TIMEOUT, socket.connect(&source.endpoint))
        .await
        .map_err(|_| "connection timed out".to_owned())?
        .map_err(|err| err.to_string())?;
    socket
        .subscribe(&source.topic)
        .await
        .map_err(|err| err.to_string())?;
    Ok(socket)
}

/// Reads messages until the socket fails; every batch is applied in order, after (with
/// `catch_up`) every batch the engine's replay socket still keeps.
async fn stream(
    tracker: &KvTracker,
    slot: EngineSlot,
    source: &Source,
    mut socket: SubSocket,
    catch_up: bool,
) {
    // The next sequence number due, once one message was seen; the batches the catch-up
    // applied (the subscription may deliver some of them again).
    let (mut due, mut replayed) = (None, None);
    if let (true, Some(replay)) = (catch_up, &source.replay) {
        let started = std::time::Instant::now();
        match tokio::time::timeout(CATCH_UP_TIMEOUT, fetch(replay, 0)).await {
            Ok(Ok(history)) if !history.is_empty() => {
                for message in &history {
                    tracker.apply(slot, message.seq, &message.payload);
                }
                let (from, to) = (history[0].seq, history[history.len() - 1].seq);
                (due, replayed) = (Some(to + 1), Some(from..=to));
                tracing::info!(endpoint = %source.endpoint, batches = history.len(), took = ?started.elapsed(), "KV events: caught up on the engine's kept history");
            }
            Ok(Ok(_)) => {}
            Ok(Err(err)) => {
                tracing::info!(endpoint = %source.endpoint, "KV events: no history replayed: {err}")
            }
            Err(_) => {
                tracing::info!(endpoint = %source.endpoint, "KV events: the history replay timed out")
            }
        }
    }
    loop {
        let frames = match socket.recv().await {
            Ok(message) => message.into_vec(),
            Err(err) => {
                tracing::debug!(endpoint = %source.endpoint, "KV events: subscription ended: {err}");
                return;
            }
        };
        let message = match message(&frames) {
            Ok(Some(message)) => message,
            Ok(None) => continue,
            Err(err) => {
                tracker.feed(slot).malformed();
                tracing::debug!(endpoint = %source.endpoint, "KV events: {err}");
                continue;
            }
        };
        match due {
            Some(next)
                if message.seq < next
                    && replayed.as_ref().is_some_and(|r| r.contains(&message.seq)) =>
            {
                // Delivered live while the catch-up replayed it.
                continue;
            }
            Some(next) if message.seq < next => {
                tracing::info!(endpoint = %source.endpoint, seq = message.seq, expected = next, "KV events: the sequence started again (engine restarted): its entries are dropped");
                tracker.rebuild(slot);
            }
            Some(next) if message.seq > next => {
                let filled = match &source.replay {
                    Some(replay) => fill(tracker, slot, replay, next, message.seq).await,
                    None => false,
                };
                tracker.feed(slot).gap(filled);
                if !filled {
                    tracing::info!(endpoint = %source.endpoint, from = next, to = message.seq, "KV events: a gap that replay cannot fill: the engine's entries are dropped and rebuilt");
                    tracker.rebuild(slot);
                }
            }
            _ => {}
        }
        tracker.apply(slot, message.seq, &message.payload);
        due = Some(message.seq + 1);
        replayed = None;
    }
}

/// Fetches batches `from..to` from the replay socket and applies them; whether every one came.
async fn fill(tracker: &KvTracker, slot: EngineSlot, replay: &str, from: u64, to: u64) -> bool {
    let fetched = tokio::time::timeout(ZMQ_TIMEOUT, fetch(replay, from)).await;
    let Ok(Ok(batches)) = fetched else {
        return false;
    };
    let wanted: Vec<&Message> = batches
        .iter()
        .filter(|m| (from..to).contains(&m.seq))
        .collect();
    let complete =
        wanted.len() as u64 == to - from && wanted.iter().zip(from..).all(|(m, seq)| m.seq == seq);
    if complete {
        for message in wanted {
            tracker.apply(slot, message.seq, &message.payload);
        }
    }
    complete
}

/// Asks the replay socket for every batch from `from` on, until its end marker.
async fn fetch(replay: &str, from: u64) -> Result<Vec<Message>, String> {
    let mut socket = DealerSocket::new();
    socket
        .connect(replay)
        .await
        .map_err(|err| err.to_string())?;
    // A REQ-style envelope: the empty delimiter, then the start sequence.
    let request: ZmqMessage = vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())]
        .try_into()
        .map_err(|_| "an empty request".to_owned())?;
    socket.send(request).await.map_err(|err| err.to_string())?;
    let mut batches = Vec::new();
    loop {
        let frames = socket
            .recv()
            .await
            .map_err(|err| err.to_string())?
            .into_vec();
        match message(&frames)? {
            Some(message) if batches.len() < MAX_REPLAY => batches.push(message),
            Some(_) => return Err(format!("more than {MAX_REPLAY} batches replayed")),
            None => return Ok(batches),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_give_the_sequence_and_the_payload() {
        let frames = [
            Bytes::from_static(b"kv"),
            Bytes::copy_from_slice(&7u64.to_be_bytes()),
            Bytes::from_static(b"payload"),
        ];
        let live = message(&frames).unwrap().unwrap();
        assert_eq!((live.seq, &live.payload[..]), (7, &b"payload"[..]));
        // A replayed one, after the empty delimiter; and the end marker.
        let replayed = [&[Bytes::new()][..], &frames[..]].concat();
        assert_eq!(message(&replayed).unwrap().unwrap().seq, 7);
        let end = [
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
            Bytes::new(),
        ];
        assert!(message(&end).unwrap().is_none());
        assert!(message(&frames[..1]).is_err());
        assert!(message(&[Bytes::new(), Bytes::from_static(b"123"), Bytes::new()]).is_err());
    }
}
