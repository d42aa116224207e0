//! D side of the UCX transport: fetch the descriptor over HTTP, hand the pull to the engine
//! thread ([`super::engine`]), release the blocks at P.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::context::Context;
use super::descriptor::{from_hex, KvDescriptor};
use super::engine::{self, EngineHandle, PullConfig, PullFailure, PullJob};
use super::UcxError;
use crate::pull::{held_get, pull_url, PullClient};
use crate::{TransferError, Transport};

/// How long the release of a pulled transfer at P may take.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// D side: pulls KV from `ucx://` exporters. Cheap to clone; share one per process (it owns a
/// UCX context and one engine thread).
#[derive(Clone)]
pub struct UcxPuller {
    engine: Arc<EngineHandle>,
    http: PullClient,
    config: PullConfig,
}

impl UcxPuller {
    /// Initializes UCX (honouring `UCX_TLS` etc.) and starts the engine thread.
    pub fn new(config: PullConfig) -> Result<Self, TransferError> {
        let setup = |err: UcxError| TransferError::Transport {
            addr: String::new(),
            transfer_id: String::new(),
            reason: format!("cannot start UCX: {err}"),
        };
        let context = Context::new().map_err(setup)?;
        let engine = Arc::new(engine::start(context, config).map_err(setup)?);
        let http = PullClient::new(config.connect_timeout);
        Ok(UcxPuller {
            engine,
            http,
            config,
        })
    }

    /// Pulls the KV published under `transfer_id` at `addr` (`ucx://host:port`) into `buffer`
    /// (its allocation is reused when large enough) and returns it. Waits for P to publish for
    /// at most `deadline`, which bounds the whole call; then releases the blocks at P.
    pub async fn pull(
        &self,
        addr: &str,
        transfer_id: &str,
        deadline: Duration,
        buffer: Vec<u8>,
    ) -> Result<Vec<u8>, TransferError> {
        let started = Instant::now();
        let host_port = match Transport::parse(addr)? {
            (Transport::Ucx, host_port) => host_port,
            (other, _) => {
                return Err(TransferError::UnsupportedAddress {
                    addr: addr.to_owned(),
                    reason: format!("the UCX puller cannot pull from a {other} address"),
                })
            }
        };
        let url = pull_url(host_port, transfer_id, deadline);
        let body = held_get(&self.http, &url, (addr, transfer_id), deadline, Vec::new()).await?;
        let described = Instant::now();
        let pulled = self
            .pull_described(
                addr,
                transfer_id,
                &body,
                // A deadline too far to represent is no deadline.
                started
                    .checked_add(deadline)
                    .unwrap_or(started + Duration::from_secs(365 * 86_400)),
                deadline,
                buffer,
            )
            .await;
        let data = described.elapsed();
        self.release(host_port, transfer_id).await;
        tracing::debug!(
            %transfer_id,
            bytes = pulled.as_ref().map_or(0, Vec::len),
            descriptor_ms = (described - started).as_secs_f64() * 1e3,
            data_ms = data.as_secs_f64() * 1e3,
            release_ms = (described.elapsed() - data).as_secs_f64() * 1e3,
            "UCX pull"
        );
        pulled
    }

    /// Pulls what the descriptor `body` describes, by `until` (the end of `deadline`).
    async fn pull_described(
        &self,
        addr: &str,
        transfer_id: &str,
        body: &[u8],
        until: Instant,
        deadline: Duration,
        buffer: Vec<u8>,
    ) -> Result<Vec<u8>, TransferError> {
        let bad = |reason: String| TransferError::Descriptor {
            addr: addr.to_owned(),
            transfer_id: transfer_id.to_owned(),
            reason,
        };
        let descriptor: KvDescriptor =
            serde_json::from_slice(body).map_err(|e| bad(e.to_string()))?;
        if descriptor.len > self.config.max_bytes {
            return Err(bad(format!(
                "len {} is more than this puller accepts ({} bytes)",
                descriptor.len, self.config.max_bytes
            )));
        }
        let chunks = descriptor.chunks(self.config.chunk_bytes).map_err(bad)?;
        let worker_address = from_hex(&descriptor.worker_address).map_err(bad)?;
        let rkey = from_hex(&descriptor.rkey).map_err(bad)?;
        let failed = |reason: String| TransferError::Transport {
            addr: addr.to_owned(),
            transfer_id: transfer_id.to_owned(),
            reason,
        };
        let named = |failure: PullFailure| match failure {
            PullFailure::Ucx(err) => failed(err.to_string()),
            PullFailure::Memory(reason) => failed(format!("no memory for the KV: {reason}")),
            PullFailure::Region(reason) => bad(reason),
            PullFailure::Deadline { done } => TransferError::Deadline {
                addr: addr.to_owned(),
                transfer_id: transfer_id.to_owned(),
                deadline,
                done,
                total: descriptor.len,
            },
        };
        let (reply, answer) = oneshot::channel();
        let job = PullJob {
            worker_address,
            rkey,
            region: (descriptor.base, descriptor.region_len as usize),
            chunks,
            len: descriptor.len as usize,
            buffer,
            deadline: until,
            reply,
        };
        let stopped = || failed("the UCX engine thread stopped".into());
        let jobs = self.engine.jobs.as_ref().ok_or_else(stopped)?;
        jobs.send(job).map_err(|_| stopped())?;
        // The engine enforces the deadline itself; the margin covers closing an endpoint.
        let margin = until.saturating_duration_since(Instant::now()) + Duration::from_secs(3);
        match tokio::time::timeout(margin, answer).await {
            Ok(Ok(result)) => result.map_err(named),
            Ok(Err(_)) => Err(stopped()),
            Err(_) => Err(named(PullFailure::Deadline { done: 0 })),
        }
    }

    /// Tells P the blocks of `transfer_id` are free again (best effort: P reclaims them after
    /// its hold time anyway).
    async fn release(&self, host_port: &str, transfer_id: &str) {
        let id: String = url::form_urlencoded::byte_serialize(transfer_id.as_bytes()).collect();
        let url = format!("http://{host_port}/kv/{id}");
        let call = self.http.delete(&url);
        match tokio::time::timeout(RELEASE_TIMEOUT, call).await {
            Ok(Ok(status)) if status.is_success() => {}
            Ok(Ok(status)) => tracing::debug!(%url, %status, "KV release refused"),
            Ok(Err(err)) => tracing::debug!(%url, error = %err, "KV release failed"),
            Err(_) => tracing::debug!(%url, "KV release timed out"),
        }
    }
}
