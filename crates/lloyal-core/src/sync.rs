//! Locks.

use std::sync::{Mutex, MutexGuard};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks cannot leave their plain data
    // half-written, so a poisoned lock is still safe to use.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
