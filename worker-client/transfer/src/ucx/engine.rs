//! D's UCX engine: one thread that owns D's worker, connects to P workers (an endpoint and
//! its unpacked remote keys cached per peer), and drives every pull's batched `ucp_get_nbx`
//! until its bytes are in or its deadline has passed. [`super::puller`] hands it the pulls.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::context::Context;
use super::descriptor::Chunk;
use super::worker::{Endpoint, RemoteKey, Request, Worker};
use super::UcxError;

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

/// Why the engine could not finish a pull.
pub(super) enum PullFailure {
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
pub(super) struct PullJob {
    pub(super) worker_address: Vec<u8>,
    pub(super) rkey: Vec<u8>,
    /// The remote region the key covers: (base, length).
    pub(super) region: (u64, usize),
    pub(super) chunks: Vec<Chunk>,
    pub(super) len: usize,
    pub(super) buffer: Vec<u8>,
    pub(super) deadline: Instant,
    pub(super) reply: oneshot::Sender<Result<Vec<u8>, PullFailure>>,
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
pub(super) struct EngineHandle {
    pub(super) jobs: Option<mpsc::Sender<PullJob>>,
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

/// Starts the engine thread on a worker of `context`; returns once the worker exists.
pub(super) fn start(context: Arc<Context>, config: PullConfig) -> Result<EngineHandle, UcxError> {
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
        .map_err(|_| UcxError::new("std::thread::spawn", ucx_sys::UCS_ERR_NO_RESOURCE))?;
    // Dropped on error, which joins the thread.
    let engine = EngineHandle {
        jobs: Some(jobs),
        thread: Some(thread),
    };
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(engine),
        Ok(Err(err)) => Err(err),
        Err(_) => Err(UcxError::new(
            "ucp_worker_create",
            ucx_sys::UCS_ERR_NO_MESSAGE,
        )),
    }
}
