//! Reading a client's request body under the proxy's limits: at most `--max-body-bytes`, the
//! whole within `--body-read-timeout`, and every chunk within a memory budget shared by all
//! requests (`--body-memory-bytes`), so that slow or stalled clients cost bounded time and memory.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::ClientLimits;

/// The budget's unit: one permit holds this many bytes.
const UNIT: usize = 1024;

/// Why a body could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum IntakeError {
    /// Over the size limit.
    #[error("the request body is larger than {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// Not all of it arrived (or found room) in time.
    #[error("the request body did not arrive within {0:?}")]
    Timeout(Duration),
    /// The connection broke while it arrived.
    #[error("the request body could not be read: {0}")]
    Broken(String),
}

/// A body read whole, holding its share of the memory budget until dropped.
pub(crate) struct Intaken {
    /// The bytes.
    pub bytes: Bytes,
    _budget: Option<OwnedSemaphorePermit>,
}

impl Intaken {
    /// The bytes, with their share of the budget given back: the budget bounds what slow
    /// clients hold while their bodies arrive, and this one has arrived.
    pub(crate) fn release(self) -> Bytes {
        self.bytes
    }
}

/// The reader of request bodies.
pub(crate) struct Intake {
    budget: Arc<Semaphore>,
    max_bytes: usize,
    deadline: Duration,
}

impl Intake {
    /// A reader with `limits`.
    pub(crate) fn new(limits: &ClientLimits) -> Self {
        Intake {
            budget: Arc::new(Semaphore::new(limits.body_memory_bytes.div_ceil(UNIT))),
            max_bytes: limits.max_body_bytes,
            deadline: limits.body_read_timeout,
        }
    }

    /// Reads `body` whole.
    pub(crate) async fn read(&self, body: Body) -> Result<Intaken, IntakeError> {
        match tokio::time::timeout(self.deadline, self.read_all(body)).await {
            Ok(read) => read,
            Err(_) => Err(IntakeError::Timeout(self.deadline)),
        }
    }

    async fn read_all(&self, body: Body) -> Result<Intaken, IntakeError> {
        let mut stream = body.into_data_stream();
        // The chunks as they came (no buffer grown by doubling while a body trickles in), joined
        // once at the end.
        let mut chunks: Vec<Bytes> = Vec::new();
        let mut total = 0;
        let mut held: Option<OwnedSemaphorePermit> = None;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|err| IntakeError::Broken(err.to_string()))?;
            total += chunk.len();
            if total > self.max_bytes {
                return Err(IntakeError::TooLarge {
                    limit: self.max_bytes,
                });
            }
            // Room for the chunk before it is kept: waits while other bodies fill the budget.
            let have = held.as_ref().map_or(0, |p| p.num_permits());
            let need = total.div_ceil(UNIT).saturating_sub(have);
            if need > 0 {
                let more = self
                    .budget
                    .clone()
                    .acquire_many_owned(need as u32)
                    .await
                    .map_err(|_| IntakeError::Broken("the proxy is shutting down".into()))?;
                match &mut held {
                    Some(permit) => permit.merge(more),
                    None => held = Some(more),
                }
            }
            chunks.push(chunk);
        }
        let bytes = match chunks.len() {
            0 => Bytes::new(),
            1 => chunks.remove(0),
            _ => {
                let mut whole = BytesMut::with_capacity(total);
                for chunk in &chunks {
                    whole.extend_from_slice(chunk);
                }
                whole.freeze()
            }
        };
        Ok(Intaken {
            bytes,
            _budget: held,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max: usize, memory: usize, timeout_ms: u64) -> ClientLimits {
        ClientLimits {
            header_read_timeout: Duration::from_secs(1),
            body_read_timeout: Duration::from_millis(timeout_ms),
            max_body_bytes: max,
            body_memory_bytes: memory,
            max_connections: 1,
        }
    }

    #[tokio::test]
    async fn bodies_are_bounded_in_size_time_and_memory() {
        let intake = Intake::new(&limits(4096, 4096, 200));
        let read = intake.read(Body::from(vec![1u8; 3000])).await.unwrap();
        assert_eq!(read.bytes.len(), 3000);
        assert!(matches!(
            intake.read(Body::from(vec![1u8; 5000])).await,
            Err(IntakeError::TooLarge { limit: 4096 })
        ));
        // While the first body holds 3 of 4 KiB, a second of 2 KiB waits, and times out.
        assert!(matches!(
            intake.read(Body::from(vec![1u8; 2000])).await,
            Err(IntakeError::Timeout(_))
        ));
        drop(read);
        assert!(intake.read(Body::from(vec![1u8; 2000])).await.is_ok());
        // A body that never ends times out.
        let (_sender, stalled) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
        let body = Body::from_stream(tokio_stream_from(stalled));
        assert!(matches!(
            intake.read(body).await,
            Err(IntakeError::Timeout(_))
        ));
    }

    fn tokio_stream_from(
        mut receiver: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
    ) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
        futures_util::stream::poll_fn(move |cx| receiver.poll_recv(cx))
    }
}
