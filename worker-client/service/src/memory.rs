//! What a server allocating with mimalloc needs of its process.
//!
//! pd-proxy and bootstrap-server allocate with mimalloc (built without its transparent huge
//! page advice, `no_thp`): glibc's malloc and free were a tenth of the proxy's CPU and about a
//! quarter of a durable registration's instructions. Each binary declares the allocator itself
//! (a library that did would impose it on every program linking it, the Python module
//! included) and calls [`disable_transparent_huge_pages`] first thing.

/// Turns transparent huge pages off for this process. mimalloc's arenas are 2 MiB aligned, so
/// where THP is on (`always`, or `madvise` with mimalloc's own advice, which the `no_thp` build
/// drops) every arena touched costs a whole 2 MiB page: with 100 stalled client bodies the
/// proxy's memory grew from 65-90 MiB to 93-121 MiB.
pub fn disable_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes integer arguments and touches no memory.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}
