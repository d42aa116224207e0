//! P side of the UCX transport: KV in UCX-allocated blocks, a descriptor per transfer on the
//! HTTP listener, and a progress thread for what is not one-sided.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use super::context::Context;
use super::descriptor::{to_hex, KvDescriptor};
use super::pool::{BlockPool, Lease};
use super::worker::Worker;
use super::UcxError;
use crate::pull::PullParams;
use crate::shelf::{listen, spawn_janitor, Shelf};
use crate::{ExportConfig, TransferError, UCX_SCHEME};

/// How long the progress thread sleeps at most when idle (also how soon it sees a stop).
const IDLE_WAIT: Duration = Duration::from_millis(50);

/// The thread that owns P's worker and progresses it: wire-up of D's endpoints, and the data of
/// gets that are not one-sided (TCP, or memory a shared-memory peer cannot map).
struct ProgressThread {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ProgressThread {
    /// Starts the thread; returns it and the worker's address.
    fn start(context: Arc<Context>) -> Result<(Self, Vec<u8>), UcxError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ucx-export".into())
            .spawn(move || {
                let worker = match Worker::new(&context).and_then(|w| Ok((w.address()?, w))) {
                    Ok((address, worker)) => {
                        let _ = ready_tx.send(Ok(address));
                        worker
                    }
                    Err(err) => {
                        let _ = ready_tx.send(Err(err));
                        return;
                    }
                };
                while !stopping.load(Ordering::Acquire) {
                    while worker.progress() > 0 {}
                    if let Err(err) = worker.wait(IDLE_WAIT) {
                        tracing::warn!(error = %err, "UCX progress thread cannot sleep");
                        std::thread::sleep(IDLE_WAIT);
                    }
                }
            })
            .map_err(|_| UcxError::new("std::thread::spawn", ucx_sys::UCS_ERR_NO_RESOURCE))?;
        // Dropped on error, which joins the thread.
        let started = ProgressThread {
            stop,
            thread: Some(thread),
        };
        match ready_rx.recv() {
            Ok(Ok(address)) => Ok((started, address)),
            Ok(Err(err)) => Err(err),
            Err(_) => Err(UcxError::new(
                "ucp_worker_create",
                ucx_sys::UCS_ERR_NO_MESSAGE,
            )),
        }
    }
}

impl Drop for ProgressThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct ExportState {
    /// Declared first so it is dropped first: the progress thread stops serving gets before the
    /// pool's memory is unmapped.
    _progress: ProgressThread,
    /// Published, not yet pulled.
    shelf: Shelf<Lease>,
    /// How long a transfer is held, published or in flight.
    hold: Duration,
    /// Described to a D, not yet released: (blocks, when they are reclaimed regardless).
    in_flight: Mutex<HashMap<String, (Lease, Instant)>>,
    pool: Arc<BlockPool>,
    worker_address: String,
    rkey: String,
}

impl ExportState {
    fn in_flight(&self) -> MutexGuard<'_, HashMap<String, (Lease, Instant)>> {
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn describe(&self, lease: &Lease) -> KvDescriptor {
        KvDescriptor {
            worker_address: self.worker_address.clone(),
            rkey: self.rkey.clone(),
            base: self.pool.region().address(),
            region_len: self.pool.region().len() as u64,
            block_bytes: self.pool.block_bytes() as u64,
            ranges: lease.ranges().to_vec(),
            len: lease.len() as u64,
        }
    }

    fn sweep(&self) -> usize {
        let now = Instant::now();
        let mut in_flight = self.in_flight();
        let before = in_flight.len();
        in_flight.retain(|_, (_, expires)| *expires > now);
        let reclaimed = before - in_flight.len();
        drop(in_flight);
        self.shelf.sweep() + reclaimed
    }
}

async fn describe(
    State(state): State<Arc<ExportState>>,
    Path(transfer_id): Path<String>,
    Query(params): Query<PullParams>,
) -> Response {
    let wait = Duration::from_millis(params.wait_ms);
    let Some(lease) = state.shelf.take_within(&transfer_id, wait).await else {
        return (StatusCode::NOT_FOUND, "not published").into_response();
    };
    let descriptor = state.describe(&lease);
    // The blocks stay reserved until D releases them, or for the hold time (at least as long as
    // D said it would wait, which bounds its pull).
    let expires = Instant::now() + state.hold.max(wait);
    let mut in_flight = state.in_flight();
    if in_flight.contains_key(&transfer_id) {
        // A second pull of an id already described: its blocks may still be read; never hand
        // them to a second transfer under the same id.
        return (StatusCode::CONFLICT, "already being pulled").into_response();
    }
    in_flight.insert(transfer_id, (lease, expires));
    drop(in_flight);
    Json(descriptor).into_response()
}

async fn release(
    State(state): State<Arc<ExportState>>,
    Path(transfer_id): Path<String>,
) -> StatusCode {
    match state.in_flight().remove(&transfer_id) {
        Some(_) => StatusCode::NO_CONTENT,
        None => StatusCode::NOT_FOUND,
    }
}

/// P side: publishes KV into UCX-allocated memory and serves its descriptor at
/// `ucx://host:port`.
#[derive(Clone)]
pub struct UcxExporter {
    state: Arc<ExportState>,
    addr: SocketAddr,
}

impl UcxExporter {
    /// Allocates `config.pool_bytes` through UCX, starts the progress thread, and listens on
    /// `addr` (port 0 picks one) until the runtime stops.
    pub async fn bind(addr: SocketAddr, config: ExportConfig) -> Result<Self, TransferError> {
        let setup = |err: UcxError| TransferError::Bind {
            addr,
            reason: err.to_string(),
        };
        if config.block_bytes == 0 || config.pool_bytes < config.block_bytes {
            return Err(TransferError::Bind {
                addr,
                reason: format!(
                    "the KV pool ({} bytes) must hold at least one block ({} bytes)",
                    config.pool_bytes, config.block_bytes
                ),
            });
        }
        let context = Context::new().map_err(setup)?;
        let region = context.allocate(config.pool_bytes).map_err(setup)?;
        let rkey = to_hex(&region.pack_rkey().map_err(setup)?);
        let (progress, worker_address) = ProgressThread::start(context).map_err(setup)?;
        let state = Arc::new(ExportState {
            shelf: Shelf::new(config.hold),
            hold: config.hold,
            in_flight: Mutex::new(HashMap::new()),
            pool: BlockPool::new(region, config.block_bytes),
            worker_address: to_hex(&worker_address),
            rkey,
            _progress: progress,
        });
        let app = Router::new()
            .route("/kv/{transfer_id}", get(describe).delete(release))
            .with_state(state.clone());
        let addr = listen(addr, app).await?;
        spawn_janitor(Arc::downgrade(&state), config.hold, ExportState::sweep);
        Ok(UcxExporter { state, addr })
    }

    /// The address to register: `ucx://host:port`.
    pub fn transfer_addr(&self) -> String {
        format!("{UCX_SCHEME}://{}", self.addr)
    }

    /// Copies `kv` into free blocks and makes it available under `transfer_id`, waking a D
    /// already waiting for it.
    pub fn publish(&self, transfer_id: &str, kv: &[u8]) -> Result<(), TransferError> {
        let lease = self.state.pool.lease(kv)?;
        self.state.shelf.publish(transfer_id, lease);
        Ok(())
    }

    /// How many transfers are published and not yet described to a D, or awaited.
    pub fn pending(&self) -> usize {
        self.state.shelf.pending()
    }

    /// How many transfers D is pulling (described, not yet released or expired).
    pub fn in_flight(&self) -> usize {
        self.state.in_flight().len()
    }

    /// Bytes of the pool free for new transfers.
    pub fn free_bytes(&self) -> usize {
        self.state.pool.free_bytes()
    }
}
