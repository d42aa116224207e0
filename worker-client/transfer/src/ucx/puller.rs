//! D side of the UCX transport: fetch the descriptor over HTTP, pull the blocks with batched
//! `ucp_get_nbx` on a dedicated engine thread, release them at P.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::context::Context;
use super::descriptor::{from_hex, Chunk, KvDescriptor};
use super::worker::{Endpoint, RemoteKey, Request, Worker};
use super::UcxError;
use crate::pull::{held_get, pull_url, PullClient};
use crate::{TransferError, Transport};

/// How often an idle engine progresses its worker (keep-alives, endpoint errors).
const IDLE_TICK: Duration = Duration::from_millis(10);

/// How long an unused peer (endpoint and remote keys) is kept for the next pull.
const PEER_IDLE: Duration = Duration::from_secs(120);

/// Rounds of progress without any get completing before the engine sleeps between rounds.
const SPINS_BEFORE_SLEEP: u32 = 1_000;

/// How long the engine sleeps per round while pulls are stalled (deadlines are checked after).
const STALLED_SLEEP: Duration = Duration::from_millis(1);
/// How many unpacked remote keys an endpoint keeps (P has one per region, so a few suffice).
const RKEYS_PER_ENDPOINT: usize = 8;
/// How long the release of a pulled transfer at P may take.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(2);

/// How pulls are cut and batched.
#[derive(Debug, Clone, Copy)]
pub struct PullConfig {
    /// Bytes per get.
    pub chunk_bytes: usize,
    /// Gets in flight per pull.
    pub window: usize,
    /// How long the HTTP connection to P's listener may take to open.
    pub connect_timeout: Duration,
    /// The largest transfer a descriptor may announce: D allocates that much before pulling,
    /// so a wrong or hostile descriptor must not be able to ask for more.
    pub max_bytes: u64,
}

impl Default for PullConfig {
    fn default() -> Self {
        PullConfig {
            chunk_bytes: 4 << 20,
            window: 8,
            connect_timeout: Duration::from_secs(3),
            max_bytes: 4 << 30,
        }
    }
}

/// Why the engine could not finish a pull.
enum PullFailure {
    Ucx(UcxError),
    Deadline {
        done: u64,
    },
    /// The receive buffer could not be allocated.
    Memory(String),
    /// The descriptor announced another region for a key already mapped.
    Region(String),
}

/// One pull handed to the engine thread.
struct PullJob {
    worker_address: Vec<u8>,
    rkey: Vec<u8>,
    /// The remote region the key covers: (base, length).
    region: (u64, usize),
    chunks: Vec<Chunk>,
    len: usize,
    buffer: Vec<u8>,
    deadline: Instant,
    reply: oneshot::Sender<Result<Vec<u8>, PullFailure>>,
}

/// A pull the engine is working on.
struct Active {
    endpoint: Endpoint,
    rkey: Rc<RemoteKey>,
    chunks: VecDeque<Chunk>,
    in_flight: VecDeque<(Request, usize)>,
    done: u64,
    len: usize,
    /// Written only by UCX gets until the pull ends; its length is set once every byte arrived.
    buffer: Vec<u8>,
    deadline: Instant,
    failed: Option<UcxError>,
    reply: oneshot::Sender<Result<Vec<u8>, PullFailure>>,
}

impl Drop for Active {
    /// A pull dropped with gets still running (the engine unwinding from a panic, or stopping)
    /// must not free the buffer they write into: it is leaked instead.
    fn drop(&mut self) {
        self.leak_buffer_if_running();
    }
}

/// What one step of a pull came to.
enum Step {
    Running,
    Finished,
    /// Finished, and the endpoint is not to be reused.
    FinishedBadEndpoint,
    /// The deadline passed with gets outstanding: the engine decides whether the endpoint is
    /// closed (see [`Active::give_up`]).
    Expired,
}

impl Active {
    fn step(&mut self, window: usize) -> Step {
        let (done, failed) = (&mut self.done, &mut self.failed);
        self.in_flight
            .retain(|(request, len)| match request.poll() {
                None => true,
                Some(Ok(())) => {
                    *done += *len as u64;
                    false
                }
                Some(Err(err)) => {
                    failed.get_or_insert(err);
                    false
                }
            });
        while self.failed.is_none() && self.in_flight.len() < window {
            let Some(chunk) = self.chunks.pop_front() else {
                break;
            };
            // SAFETY: the chunk lies inside the buffer's capacity (chunks tile 0..len and the
            // capacity is at least len), the buffer is not touched until every get has ended,
            // and a pull that ends with gets still running leaks it instead of freeing it.
            let started = unsafe {
                self.endpoint.get(
                    self.buffer.as_mut_ptr().add(chunk.local),
                    chunk.len,
                    chunk.remote,
                    &self.rkey,
                )
            };
            match started {
                Ok(None) => self.done += chunk.len as u64,
                Ok(Some(request)) => self.in_flight.push_back((request, chunk.len)),
                Err(err) => self.failed = Some(err),
            }
        }
        if self.in_flight.is_empty() && (self.failed.is_some() || self.chunks.is_empty()) {
            return self.finish();
        }
        if Instant::now() >= self.deadline {
            return Step::Expired;
        }
        Step::Running
    }

    fn finish(&mut self) -> Step {
        let (result, step) = match self.failed.take() {
            None => {
                // SAFETY: every chunk completed, and the chunks tile 0..len: all bytes written.
                unsafe { self.buffer.set_len(self.len) };
                (Ok(std::mem::take(&mut self.buffer)), Step::Finished)
            }
            Some(err) => (Err(PullFailure::Ucx(err)), Step::FinishedBadEndpoint),
        };
        self.reply_once(result);
        step
    }

    /// The deadline passed with gets outstanding (P died or stalled, or this pull ran out of
    /// its own time): with `close`, close the endpoint so they end; leak the buffer if some
    /// still run.
    fn give_up(&mut self, close: bool) {
        if close {
            self.endpoint.close();
        }
        let running = self.leak_buffer_if_running();
        if running > 0 {
            tracing::warn!(
                running,
                "UCX gets still running after the endpoint closed; leaking their buffer"
            );
        }
        let done = self.done;
        self.reply_once(Err(PullFailure::Deadline { done }));
    }

    /// Forgets finished gets; if some still run, leaks the buffer they write into (it is never
    /// freed under a running get). Returns how many still run.
    fn leak_buffer_if_running(&mut self) -> usize {
        self.in_flight
            .retain(|(request, _)| request.poll().is_none());
        if !self.in_flight.is_empty() {
            std::mem::forget(std::mem::take(&mut self.buffer));
        }
        self.in_flight.len()
    }

    fn reply_once(&mut self, result: Result<Vec<u8>, PullFailure>) {
        let (reply, _) = oneshot::channel();
        // The caller may have stopped waiting; then nobody needs the answer.
        let _ = std::mem::replace(&mut self.reply, reply).send(result);
    }
}

/// A remote region: (base address, length).
type Region = (u64, usize);

/// A connected peer: its endpoint and the remote keys unpacked for it. Unpacking maps P's
/// shared-memory segment afresh, and the first touch of every page of a fresh mapping costs a
/// page fault, so keys are kept for the next pull of the same region.
struct Peer {
    endpoint: Endpoint,
    /// When a pull last used it.
    last_used: Instant,
    /// Each key with the region (base, length) its first descriptor announced.
    rkeys: HashMap<Vec<u8>, (Rc<RemoteKey>, Region)>,
}

impl Peer {
    /// The key for `packed`, unpacked (and its region `base..base + len` prefaulted) once. A
    /// later descriptor must announce the same region for the same key: the mapping was made
    /// (and prefaulted) for it.
    fn rkey(&mut self, packed: &[u8], base: u64, len: usize) -> Result<Rc<RemoteKey>, PullFailure> {
        if let Some((rkey, region)) = self.rkeys.get(packed) {
            if *region != (base, len) {
                return Err(PullFailure::Region(format!(
                    "the key's region was {region:?} (base, length), now {:?}",
                    (base, len)
                )));
            }
            return Ok(rkey.clone());
        }
        let rkey = Rc::new(
            self.endpoint
                .unpack_rkey(packed)
                .map_err(PullFailure::Ucx)?,
        );
        let prefaulted = rkey.prefault(base, len);
        tracing::debug!(prefaulted, region_bytes = len, "remote key unpacked");
        if self.rkeys.len() >= RKEYS_PER_ENDPOINT {
            self.rkeys.clear();
        }
        self.rkeys
            .insert(packed.to_vec(), (rkey.clone(), (base, len)));
        Ok(rkey)
    }
}

/// The engine thread: owns the worker and a cache of peers by worker address.
struct Engine {
    worker: Worker,
    peers: HashMap<Vec<u8>, Peer>,
    active: Vec<Active>,
    config: PullConfig,
}

impl Engine {
    fn start(&mut self, job: PullJob) {
        let begun = self
            .peer(&job.worker_address)
            .map_err(PullFailure::Ucx)
            .and_then(|peer| {
                let rkey = peer.rkey(&job.rkey, job.region.0, job.region.1)?;
                Ok((peer.endpoint.clone(), rkey))
            });
        let (endpoint, rkey) = match begun {
            Ok(begun) => begun,
            Err(failure) => {
                let _ = job.reply.send(Err(failure));
                return;
            }
        };
        let mut buffer = job.buffer;
        buffer.clear();
        if let Err(err) = buffer.try_reserve(job.len) {
            let _ = job.reply.send(Err(PullFailure::Memory(err.to_string())));
            return;
        }
        self.active.push(Active {
            endpoint,
            rkey,
            chunks: job.chunks.into(),
            in_flight: VecDeque::new(),
            done: 0,
            len: job.len,
            buffer,
            deadline: job.deadline,
            failed: None,
            reply: job.reply,
        });
    }

    fn peer(&mut self, worker_address: &[u8]) -> Result<&mut Peer, UcxError> {
        if !self.peers.contains_key(worker_address) {
            let endpoint = self.worker.connect(worker_address)?;
            tracing::debug!(
                peer_failure_detection = endpoint.detects_peer_failure(),
                "UCX endpoint connected"
            );
            let peer = Peer {
                endpoint,
                last_used: Instant::now(),
                rkeys: HashMap::new(),
            };
            self.peers.insert(worker_address.to_vec(), peer);
        }
        let peer = self.peers.get_mut(worker_address).expect("inserted above");
        peer.last_used = Instant::now();
        Ok(peer)
    }

    /// Forgets peers no pull has used for [`PEER_IDLE`] (a restarted P comes back under a new
    /// worker address, so its old entry, and the mapping of its segment, would stay forever).
    /// Called only while no pull runs; a remote key keeps its endpoint open until it is gone.
    fn evict_idle_peers(&mut self) {
        let now = Instant::now();
        self.peers
            .retain(|_, peer| now.duration_since(peer.last_used) < PEER_IDLE);
    }

    fn run(mut self, jobs: mpsc::Receiver<PullJob>) {
        let mut open = true;
        let mut idle_spins = 0u32;
        loop {
            if self.active.is_empty() {
                if !open {
                    break;
                }
                match jobs.recv_timeout(IDLE_TICK) {
                    Ok(job) => self.start(job),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        self.worker.progress();
                        self.evict_idle_peers();
                        continue;
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
            }
            loop {
                match jobs.try_recv() {
                    Ok(job) => self.start(job),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            let events = self.worker.progress();
            let moved_before: u64 = self.active.iter().map(|a| a.done).sum();
            let active_before = self.active.len();
            let window = self.config.window.max(1);
            let (mut bad, mut expired) = (Vec::new(), Vec::new());
            let mut i = 0;
            while i < self.active.len() {
                match self.active[i].step(window) {
                    Step::Running => i += 1,
                    Step::Finished => drop(self.active.swap_remove(i)),
                    Step::FinishedBadEndpoint => {
                        bad.push(self.active.swap_remove(i).endpoint.clone())
                    }
                    Step::Expired => expired.push(self.active.swap_remove(i)),
                }
            }
            for mut pull in expired {
                // Other pulls from the same P may be healthy (this one may just have run out of
                // its own time): the shared endpoint is closed, ending the outstanding gets, only
                // when no other pull uses it.
                let shared = self
                    .active
                    .iter()
                    .any(|other| other.endpoint.same_as(&pull.endpoint));
                pull.give_up(!shared);
                if !shared {
                    bad.push(pull.endpoint.clone());
                }
            }
            for endpoint in bad {
                endpoint.close();
                self.peers
                    .retain(|_, peer| !peer.endpoint.same_as(&endpoint));
            }
            // Spin while gets complete; once nothing has moved for a while (a stalled or slow
            // P), sleep on the worker's event fd instead of burning a core until the deadline.
            let moved_after: u64 = self.active.iter().map(|a| a.done).sum();
            let moved =
                events > 0 || moved_after != moved_before || self.active.len() != active_before;
            idle_spins = if moved { 0 } else { idle_spins + 1 };
            if idle_spins > SPINS_BEFORE_SLEEP {
                // A failed arm only shortens the sleep: progress is called again right after.
                let _ = self.worker.wait(STALLED_SLEEP);
            }
        }
    }
}

/// Stops the engine thread when the last puller clone is dropped.
struct EngineHandle {
    jobs: Option<mpsc::Sender<PullJob>>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

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
        let (jobs, receiver) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("ucx-pull".into())
            .spawn(move || match Worker::new(&context) {
                Ok(worker) => {
                    let _ = ready_tx.send(Ok(()));
                    Engine {
                        worker,
                        peers: HashMap::new(),
                        active: Vec::new(),
                        config,
                    }
                    .run(receiver);
                }
                Err(err) => {
                    let _ = ready_tx.send(Err(err));
                }
            })
            .map_err(|_| {
                setup(UcxError::new(
                    "std::thread::spawn",
                    ucx_sys::UCS_ERR_NO_RESOURCE,
                ))
            })?;
        // Dropped on error, which joins the thread.
        let engine = Arc::new(EngineHandle {
            jobs: Some(jobs),
            thread: Some(thread),
        });
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(err)) => return Err(setup(err)),
            Err(_) => {
                return Err(setup(UcxError::new(
                    "ucp_worker_create",
                    ucx_sys::UCS_ERR_NO_MESSAGE,
                )))
            }
        }
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
