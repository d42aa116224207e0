//! A UCP worker and what hangs off it: endpoints to peers, unpacked remote keys, and requests.
//!
//! A worker is created in `UCS_THREAD_MODE_SINGLE`: it and everything made from it must stay on
//! the thread that created it. The types here hold `Rc`s, so the compiler enforces that (none is
//! `Send` or `Sync`), and the same `Rc`s fix the drop order UCX needs: a request or remote key
//! before its endpoint, an endpoint before its worker, a worker before its context.

use std::cell::Cell;
use std::os::raw::c_void;
use std::ptr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ucx_sys::*;

use super::context::Context;
use super::status::{check, check_ptr, StatusPtr, UcxError};

/// How long closing an endpoint may progress the worker for the close to finish.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

struct WorkerInner {
    handle: ucp_worker_h,
    /// The wakeup file descriptor (owned by the worker).
    event_fd: i32,
    // Declared last: dropped after `drop` destroyed the worker.
    _context: Arc<Context>,
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        // SAFETY: every endpoint, key and request holds an Rc to this worker, so none is left.
        unsafe { ucp_worker_destroy(self.handle) }
    }
}

/// A UCP worker, owned by the thread that created it.
pub struct Worker {
    inner: Rc<WorkerInner>,
}

impl Worker {
    /// A single-threaded worker on `context`.
    pub fn new(context: &Arc<Context>) -> Result<Self, UcxError> {
        let params = ucp_worker_params_t {
            field_mask: u64::from(UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut handle = ptr::null_mut();
        // SAFETY: a live context, initialised params, a writable handle.
        check("ucp_worker_create", unsafe {
            ucp_worker_create(context.handle(), &params, &mut handle)
        })?;
        let mut inner = WorkerInner {
            handle,
            event_fd: -1,
            _context: context.clone(),
        };
        // SAFETY: a live worker of a context with UCP_FEATURE_WAKEUP; event_fd is writable.
        check("ucp_worker_get_efd", unsafe {
            ucp_worker_get_efd(handle, &mut inner.event_fd)
        })?;
        Ok(Worker {
            inner: Rc::new(inner),
        })
    }

    /// The worker's address, which a peer passes to [`Worker::connect`].
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut address = ptr::null_mut();
        let mut len = 0;
        // SAFETY: a live worker; address and len are writable.
        check("ucp_worker_get_address", unsafe {
            ucp_worker_get_address(self.inner.handle, &mut address, &mut len)
        })?;
        // SAFETY: UCX returned `len` readable bytes at `address`, released right after copying.
        let bytes = unsafe { std::slice::from_raw_parts(address.cast::<u8>(), len) }.to_vec();
        // SAFETY: the address came from this worker and is released once.
        unsafe { ucp_worker_release_address(self.inner.handle, address) };
        Ok(bytes)
    }

    /// Makes progress on every pending operation; returns how many events it handled.
    pub fn progress(&self) -> u32 {
        // SAFETY: a live worker, used on its own thread.
        unsafe { ucp_worker_progress(self.inner.handle) }
    }

    /// Sleeps until the worker has events to progress, or `timeout` passes.
    pub fn wait(&self, timeout: Duration) -> Result<(), UcxError> {
        // SAFETY: a live worker, used on its own thread.
        let status = unsafe { ucp_worker_arm(self.inner.handle) };
        if status == UCS_ERR_BUSY {
            return Ok(()); // Events arrived since the last progress: handle them first.
        }
        check("ucp_worker_arm", status)?;
        let mut fd = libc::pollfd {
            fd: self.inner.event_fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let millis = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd; an interrupted or failed poll only ends the wait early.
        unsafe { libc::poll(&mut fd, 1, millis) };
        Ok(())
    }

    /// An endpoint to the worker whose address is `remote`. Asks UCX to detect a failed peer
    /// (`UCP_ERR_HANDLING_MODE_PEER`); transports that cannot (shared memory) make that
    /// unreachable, and the endpoint is then made without it: the caller's deadline is what
    /// notices a dead peer there.
    pub fn connect(&self, remote: &[u8]) -> Result<Endpoint, UcxError> {
        match self.create_endpoint(remote, UCP_ERR_HANDLING_MODE_PEER) {
            Err(err) if err.status == UCS_ERR_UNREACHABLE => {
                tracing::debug!("peer failure detection unavailable; endpoint without it");
                self.create_endpoint(remote, UCP_ERR_HANDLING_MODE_NONE)
            }
            other => other,
        }
    }

    fn create_endpoint(
        &self,
        remote: &[u8],
        err_mode: ucp_err_handling_mode_t,
    ) -> Result<Endpoint, UcxError> {
        let detects = err_mode == UCP_ERR_HANDLING_MODE_PEER;
        let params = ucp_ep_params_t {
            field_mask: u64::from(
                UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | if detects {
                        UCP_EP_PARAM_FIELD_ERR_HANDLER
                    } else {
                        0
                    },
            ),
            address: remote.as_ptr().cast(),
            err_mode,
            err_handler: ucp_err_handler {
                cb: Some(on_peer_failure),
                arg: ptr::null_mut(),
            },
            ..Default::default()
        };
        let mut handle = ptr::null_mut();
        // SAFETY: a live worker; the address bytes outlive the call (UCX unpacks them in it).
        check("ucp_ep_create", unsafe {
            ucp_ep_create(self.inner.handle, &params, &mut handle)
        })?;
        Ok(Endpoint {
            inner: Rc::new(EndpointInner {
                handle: Cell::new(handle),
                detects_peer_failure: detects,
                worker: self.inner.clone(),
            }),
        })
    }
}

/// UCX's callback for a failed peer. The failure also ends the endpoint's outstanding requests
/// with an error, which is how a pull learns of it; installing the callback is what makes UCX
/// handle the failure instead of logging it as unhandled.
unsafe extern "C" fn on_peer_failure(_arg: *mut c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    tracing::debug!(status, "UCX peer failure");
}

struct EndpointInner {
    /// Null once closed.
    handle: Cell<ucp_ep_h>,
    detects_peer_failure: bool,
    worker: Rc<WorkerInner>,
}

impl EndpointInner {
    fn close(&self) {
        let handle = self.handle.replace(ptr::null_mut());
        if handle.is_null() {
            return;
        }
        // Forcing (outstanding requests end with UCS_ERR_CANCELED) needs peer error handling on
        // both sides; without it the close flushes what is outstanding.
        let params = ucp_request_param_t {
            op_attr_mask: u32::from(self.detects_peer_failure) * UCP_OP_ATTR_FIELD_FLAGS,
            flags: UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: a live endpoint, closed once (the handle is now null).
        let closing = unsafe { ucp_ep_close_nbx(handle, &params) };
        match check_ptr("ucp_ep_close_nbx", closing) {
            Ok(StatusPtr::Done) => {}
            Ok(StatusPtr::Request(request)) => {
                let request = Request {
                    handle: request,
                    _worker: self.worker.clone(),
                };
                let started = Instant::now();
                while request.poll().is_none() && started.elapsed() < CLOSE_GRACE {
                    // SAFETY: a live worker on its own thread.
                    unsafe { ucp_worker_progress(self.worker.handle) };
                }
            }
            Err(err) => tracing::debug!(error = %err, "endpoint closed with an error"),
        }
    }
}

impl Drop for EndpointInner {
    fn drop(&mut self) {
        self.close();
    }
}

/// An endpoint to a peer worker. Clones share it; it closes when the last clone goes, or at
/// once with [`Endpoint::close`].
#[derive(Clone)]
pub struct Endpoint {
    inner: Rc<EndpointInner>,
}

impl Endpoint {
    /// Whether UCX reports a failed peer on this endpoint (else only a deadline notices).
    pub fn detects_peer_failure(&self) -> bool {
        self.inner.detects_peer_failure
    }

    /// Whether `other` is a clone of this endpoint.
    pub fn same_as(&self, other: &Endpoint) -> bool {
        Rc::ptr_eq(&self.inner, &other.inner)
    }

    fn handle(&self, call: &'static str) -> Result<ucp_ep_h, UcxError> {
        let handle = self.inner.handle.get();
        if handle.is_null() {
            Err(UcxError::new(call, UCS_ERR_NOT_CONNECTED))
        } else {
            Ok(handle)
        }
    }

    /// Closes the endpoint now for every clone; outstanding requests end (with
    /// `UCS_ERR_CANCELED` when the endpoint detects peer failure), later calls fail.
    pub fn close(&self) {
        self.inner.close();
    }

    /// Unpacks a peer's packed remote key for gets through this endpoint.
    pub fn unpack_rkey(&self, packed: &[u8]) -> Result<RemoteKey, UcxError> {
        let ep = self.handle("ucp_ep_rkey_unpack")?;
        let mut handle = ptr::null_mut();
        // SAFETY: a live endpoint; the packed bytes outlive the call; handle is writable.
        check("ucp_ep_rkey_unpack", unsafe {
            ucp_ep_rkey_unpack(ep, packed.as_ptr().cast(), &mut handle)
        })?;
        Ok(RemoteKey {
            handle,
            _endpoint: self.clone(),
        })
    }

    /// Starts reading `len` bytes at the peer's `remote_address` (covered by `rkey`) into
    /// `local`. `None`: already complete.
    ///
    /// # Safety
    /// `local..local + len` must be writable and stay valid and otherwise untouched until the
    /// request completes, even if the returned [`Request`] is dropped before that.
    pub unsafe fn get(
        &self,
        local: *mut u8,
        len: usize,
        remote_address: u64,
        rkey: &RemoteKey,
    ) -> Result<Option<Request>, UcxError> {
        let ep = self.handle("ucp_get_nbx")?;
        let params = ucp_request_param_t::default();
        // SAFETY: a live endpoint and key; the buffer contract is the caller's.
        let started = unsafe {
            ucp_get_nbx(
                ep,
                local.cast::<c_void>(),
                len,
                remote_address,
                rkey.handle,
                &params,
            )
        };
        Ok(match check_ptr("ucp_get_nbx", started)? {
            StatusPtr::Done => None,
            StatusPtr::Request(handle) => Some(Request {
                handle,
                _worker: self.inner.worker.clone(),
            }),
        })
    }
}

/// A peer's remote key, unpacked for one endpoint; destroyed on drop.
pub struct RemoteKey {
    handle: ucp_rkey_h,
    // Declared last: the endpoint outlives the key.
    _endpoint: Endpoint,
}

impl RemoteKey {
    /// Maps `len` bytes of the peer's memory at `remote_address` into page tables now, when the
    /// key gives direct access (shared memory), so that later gets do not pay a page fault per
    /// 4 KiB page on first touch. Returns whether it did.
    pub fn prefault(&self, remote_address: u64, len: usize) -> bool {
        let mut local = ptr::null_mut();
        // SAFETY: a live key; local is writable. Fails (unreachable) unless directly mapped.
        let status = unsafe { ucp_rkey_ptr(self.handle, remote_address, &mut local) };
        if status != UCS_OK || local.is_null() {
            return false;
        }
        let page = 4096;
        let start = local as usize & !(page - 1);
        let len = len + (local as usize - start);
        // SAFETY: the range lies in the peer's mapped segment (UCX maps the whole region);
        // MADV_POPULATE_READ only reads it into page tables and fails harmlessly otherwise.
        unsafe { libc::madvise(start as *mut c_void, len, libc::MADV_POPULATE_READ) == 0 }
    }
}

impl Drop for RemoteKey {
    fn drop(&mut self) {
        // SAFETY: unpacked by ucp_ep_rkey_unpack and destroyed once.
        unsafe { ucp_rkey_destroy(self.handle) }
    }
}

/// An outstanding UCX request; released back to UCX on drop (if it is still running, UCX frees
/// it when it completes).
pub struct Request {
    handle: ucs_status_ptr_t,
    // Declared last: the worker outlives the request.
    _worker: Rc<WorkerInner>,
}

impl Request {
    /// `None` while in progress, then how it ended.
    pub fn poll(&self) -> Option<Result<(), UcxError>> {
        // SAFETY: a live request of a live worker.
        let status = unsafe { ucp_request_check_status(self.handle) };
        if status == UCS_INPROGRESS {
            None
        } else {
            Some(check("ucp_request_check_status", status))
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // SAFETY: a request returned by UCX, released once.
        unsafe { ucp_request_free(self.handle) }
    }
}
