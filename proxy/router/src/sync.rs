//! Locks that keep working after a panic elsewhere.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// The lock, also when a panic poisoned it: every value behind the proxy's mutexes is replaced
/// or edited whole under the lock, so a panic cannot leave one half-written.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
