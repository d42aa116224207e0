//! Small shared helpers for state behind locks and for the clock stored records use.

use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

/// Locks `mutex`, also after a panic in another holder: every critical section in this crate is
/// a single map or field update, so a poisoned lock never guards half-updated state.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Now, in milliseconds since the Unix epoch: the clock of request-id expiry times.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
