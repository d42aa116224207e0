//! The UCP context (one per exporter or puller) and memory it allocates for remote access.

use std::ffi::CStr;
use std::ptr;
use std::sync::Arc;

use ucx_sys::*;

use super::status::{check, UcxError};

/// UCX settings this crate changes from UCX's own defaults unless the environment sets them:
/// (the environment variable, the name UCX's configuration knows it by, the value). The TCP
/// transport's segments, 8 KiB to send and 64 KiB to receive by default, cut a 64 MiB KV into
/// thousands of messages; with 1 MiB segments UCX over TCP pulls faster than a plain socket
/// copy (`pd-bench transfer` on loopback: 1.1 -> 5.2 GB/s).
pub const TUNED_DEFAULTS: &[(&str, &CStr, &CStr)] = &[
    ("UCX_TCP_TX_SEG_SIZE", c"TX_SEG_SIZE", c"1m"),
    ("UCX_TCP_RX_SEG_SIZE", c"RX_SEG_SIZE", c"1m"),
];

/// A UCP context with the RMA and wakeup features, shared by the threads of one exporter or
/// puller. Cleaned up when the last worker and memory region using it are gone.
pub struct Context {
    handle: ucp_context_h,
}

// SAFETY: the context is created with `mt_workers_shared`, so UCX guards the calls that may come
// from several threads (mem_map, mem_unmap, rkey_pack, worker_create) with its own lock;
// `ucp_cleanup` runs only in `drop`, when no other reference exists.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Initializes UCX (reading `UCX_*` environment variables such as `UCX_TLS`), with this
    /// crate's [`TUNED_DEFAULTS`] for the settings the environment leaves alone.
    pub fn new() -> Result<Arc<Self>, UcxError> {
        let mut config = ptr::null_mut();
        // SAFETY: null prefix and file: the environment's `UCX_*`; config is writable.
        check("ucp_config_read", unsafe {
            ucp_config_read(ptr::null(), ptr::null(), &mut config)
        })?;
        let initialized = Self::tune(config).and_then(|()| Self::init(config));
        // SAFETY: config came from ucp_config_read and is not used after this.
        unsafe { ucp_config_release(config) };
        initialized
    }

    /// Applies the [`TUNED_DEFAULTS`] whose variable is not set in the environment.
    fn tune(config: *mut ucp_config_t) -> Result<(), UcxError> {
        for (variable, name, value) in TUNED_DEFAULTS {
            if std::env::var_os(variable).is_some() {
                continue;
            }
            // SAFETY: config is live; name and value are NUL-terminated constants.
            check("ucp_config_modify", unsafe {
                ucp_config_modify(config, name.as_ptr(), value.as_ptr())
            })?;
        }
        Ok(())
    }

    fn init(config: *const ucp_config_t) -> Result<Arc<Self>, UcxError> {
        let params = ucp_params_t {
            field_mask: u64::from(UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED),
            features: u64::from(UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP),
            mt_workers_shared: 1,
            ..Default::default()
        };
        let mut handle = ptr::null_mut();
        // SAFETY: params is initialised for the fields its mask names; config came from
        // ucp_config_read; handle is writable.
        check("ucp_init", unsafe {
            ucp_init(&params, config, &mut handle)
        })?;
        Ok(Arc::new(Context { handle }))
    }

    pub(crate) fn handle(&self) -> ucp_context_h {
        self.handle
    }

    /// Allocates `len` bytes through UCX (`UCP_MEM_MAP_ALLOCATE`), registered for remote access.
    /// With a shared-memory transport enabled UCX places it in a shared segment, which a peer
    /// on this host maps and reads without this process's CPU.
    pub fn allocate(self: &Arc<Self>, len: usize) -> Result<MemRegion, UcxError> {
        let params = ucp_mem_map_params_t {
            field_mask: u64::from(
                UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | UCP_MEM_MAP_PARAM_FIELD_FLAGS,
            ),
            address: ptr::null_mut(),
            length: len,
            flags: UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut memh = ptr::null_mut();
        // SAFETY: valid context and params; memh is writable.
        check("ucp_mem_map", unsafe {
            ucp_mem_map(self.handle, &params, &mut memh)
        })?;
        let mut attr = ucp_mem_attr_t {
            field_mask: u64::from(UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH),
            ..Default::default()
        };
        // SAFETY: memh was just mapped; attr names the fields to fill.
        let queried = check("ucp_mem_query", unsafe { ucp_mem_query(memh, &mut attr) });
        let region = MemRegion {
            memh,
            address: attr.address.cast(),
            len: attr.length.min(len),
            context: self.clone(),
        };
        queried?;
        if region.address.is_null() {
            return Err(UcxError::new("ucp_mem_query", UCS_ERR_NO_MEMORY));
        }
        Ok(region)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker and region holds an Arc to this context, so none is left.
        unsafe { ucp_cleanup(self.handle) }
    }
}

/// Memory allocated and registered by UCX; unmapped (before its context is cleaned up) on drop.
pub struct MemRegion {
    memh: ucp_mem_h,
    address: *mut u8,
    len: usize,
    // Declared last: dropped after `drop` has unmapped the memory.
    context: Arc<Context>,
}

// SAFETY: the handle is only used by rkey_pack and mem_unmap, which the context guards with its
// lock; the bytes are written only through `write`, whose callers own disjoint ranges.
unsafe impl Send for MemRegion {}
// SAFETY: as above.
unsafe impl Sync for MemRegion {}

impl MemRegion {
    /// The region's address in this process (what a peer's gets name).
    pub fn address(&self) -> u64 {
        self.address as u64
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The packed remote key a peer unpacks to read this region.
    pub fn pack_rkey(&self) -> Result<Vec<u8>, UcxError> {
        let mut buffer = ptr::null_mut();
        let mut size = 0;
        // SAFETY: context and memh are live; buffer and size are writable.
        check("ucp_rkey_pack", unsafe {
            ucp_rkey_pack(self.context.handle, self.memh, &mut buffer, &mut size)
        })?;
        // SAFETY: UCX returned `size` readable bytes at `buffer`, released right after copying.
        let packed = unsafe { std::slice::from_raw_parts(buffer.cast::<u8>(), size) }.to_vec();
        // SAFETY: buffer came from ucp_rkey_pack and is released once.
        unsafe { ucp_rkey_buffer_release(buffer) };
        Ok(packed)
    }

    /// Copies `data` to `offset`.
    ///
    /// # Safety
    /// No other thread may read or write `offset..offset + data.len()` of this process's view of
    /// the region at the same time (remote readers are the owner's protocol to order).
    pub(crate) unsafe fn write(&self, offset: usize, data: &[u8]) {
        assert!(
            offset
                .checked_add(data.len())
                .is_some_and(|end| end <= self.len),
            "write of {} bytes at {offset} outside a {}-byte region",
            data.len(),
            self.len
        );
        // SAFETY: in bounds (checked above) and unshared (the caller's contract).
        unsafe { ptr::copy_nonoverlapping(data.as_ptr(), self.address.add(offset), data.len()) }
    }
}

impl Drop for MemRegion {
    fn drop(&mut self) {
        // SAFETY: memh was mapped on this context, which is still alive (we hold an Arc).
        let status = unsafe { ucp_mem_unmap(self.context.handle, self.memh) };
        if let Err(err) = check("ucp_mem_unmap", status) {
            tracing::warn!(error = %err, "UCX memory region not unmapped");
        }
    }
}
