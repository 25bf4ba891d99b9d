//! Completing Python awaitables from the worker thread.
//!
//! Every asynchronous native call takes a `done` object: either a plain
//! `done(error, value)` callable (trio), or a [`Completion`]: an asyncio
//! future plus the [`ResultQueue`] of its event loop. For a `Completion`
//! the worker converts the result holding the GIL and appends it to the
//! queue -- no Python code runs on the worker -- then releases the GIL and
//! writes one byte to the queue's pipe, so the event loop thread wakes to a
//! free GIL and settles every queued future in one pass. The Python side is
//! `lloyal/_bridge.py`.
//!
//! Worker threads keep their Python thread state between replies (see
//! [`attach`]): creating and destroying one per reply costs tens of
//! microseconds per decode step.

use std::io::Write;
use std::mem::ManuallyDrop;
use std::os::fd::{FromRawFd, RawFd};
use std::sync::Mutex;

use lloyal_core::Reply;
use pyo3::prelude::*;

use crate::errors::to_pyerr;

/// `(target, error, value)`: a finished call, waiting for its event loop.
type Finished = (Py<PyAny>, Py<PyAny>, Py<PyAny>);

/// Finished calls of one event loop, and the pipe that wakes it.
#[pyclass(module = "lloyal._lloyal", frozen)]
pub struct ResultQueue {
    items: Mutex<Vec<Finished>>,
    wake_fd: RawFd,
}

#[pymethods]
impl ResultQueue {
    /// `wake_fd` is the non-blocking write end of a pipe that the queue's
    /// owner keeps open for as long as any [`Completion`] names it.
    #[new]
    fn new(wake_fd: RawFd) -> Self {
        Self {
            items: Mutex::new(Vec::new()),
            wake_fd,
        }
    }

    /// Take every finished `(target, error, value)`, oldest first.
    fn drain(&self) -> Vec<Finished> {
        std::mem::take(&mut *self.items())
    }
}

impl ResultQueue {
    fn items(&self) -> std::sync::MutexGuard<'_, Vec<Finished>> {
        // Pushing and taking cannot leave the list half-written.
        self.items.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Where one call's result goes: `target` (an asyncio future) is queued
/// with its result on `queue`, whose loop settles it.
#[pyclass(module = "lloyal._lloyal", frozen)]
pub struct Completion {
    target: Py<PyAny>,
    queue: Py<ResultQueue>,
    /// The object that owns the queue's pipe: it must outlive the write, so
    /// the fd cannot be closed (and its number reused) before we poke it.
    _owner: Py<PyAny>,
}

#[pymethods]
impl Completion {
    #[new]
    fn new(target: Py<PyAny>, queue: Py<ResultQueue>, owner: Py<PyAny>) -> Self {
        Self {
            target,
            queue,
            _owner: owner,
        }
    }
}

/// Write one byte to `fd` without taking ownership of it. A full pipe
/// (`EAGAIN`) already guarantees a wake-up, so errors are ignored.
fn poke(fd: RawFd) {
    // SAFETY: `fd` is open for as long as the `Completion` that names it is
    // alive (its owner closes it only when collected), and we hold that
    // `Completion` until after this call. `ManuallyDrop` keeps the `File`
    // from closing the descriptor.
    let mut file = ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
    let _ = file.write(&[1]);
}

/// Wrap `done` as an engine reply, converting the value with `convert`.
pub fn py_reply<T: Send + 'static>(
    done: Py<PyAny>,
    convert: fn(Python<'_>, T) -> PyResult<Py<PyAny>>,
) -> Reply<T> {
    Box::new(move |result| {
        lloyal_core::after_job(Box::new(move || complete(done, result, convert)));
    })
}

/// Hand `result` to `done` (under the GIL), then poke the loop's pipe.
fn complete<T>(
    done: Py<PyAny>,
    result: lloyal_core::Result<T>,
    convert: fn(Python<'_>, T) -> PyResult<Py<PyAny>>,
) {
    let wake_fd = attach(|py| {
        let (error, value) = match result.map_err(to_pyerr).and_then(|v| convert(py, v)) {
            Ok(value) => (py.None(), value),
            Err(err) => (err.into_value(py).into_any(), py.None()),
        };
        match done.cast_bound::<Completion>(py) {
            Ok(c) => {
                let c = c.get();
                let queue = c.queue.get();
                queue.items().push((c.target.clone_ref(py), error, value));
                Some(queue.wake_fd)
            }
            Err(_) => {
                if let Err(err) = done.call1(py, (error, value)) {
                    err.write_unraisable(py, Some(done.bind(py)));
                }
                None
            }
        }
    });
    if let Some(fd) = wake_fd {
        poke(fd);
    }
    // `done` (and so the pipe's owner) is released only now.
    drop(done);
}

/// A Python thread state that a worker thread keeps for its lifetime, so
/// that each [`attach`] only takes the GIL: without it every attach creates
/// a thread state and every detach destroys it again.
struct KeptThreadState;

impl KeptThreadState {
    fn new() -> Self {
        // SAFETY: called on a worker thread that does not hold the GIL and has
        // no thread state yet, while the interpreter runs (a reply is only
        // sent for a call made from Python, and workers are joined before
        // the interpreter finalizes). `PyGILState_Ensure` creates the
        // thread state and takes the GIL; `PyEval_SaveThread` releases the
        // GIL and keeps the thread state, which later ensures reuse.
        unsafe {
            pyo3::ffi::PyGILState_Ensure();
            pyo3::ffi::PyEval_SaveThread();
        }
        KeptThreadState
    }
}

impl Drop for KeptThreadState {
    fn drop(&mut self) {
        // SAFETY: runs when the worker thread exits, which happens before the
        // interpreter finalizes (see `join_workers`); `Py_IsInitialized`
        // guards the rest. The ensure/release pair balances `new`: the
        // first release keeps the GIL, the second drops the count to zero,
        // which deletes the thread state and releases the GIL.
        unsafe {
            if pyo3::ffi::Py_IsInitialized() != 0 {
                let state = pyo3::ffi::PyGILState_Ensure();
                pyo3::ffi::PyGILState_Release(pyo3::ffi::PyGILState_STATE::PyGILState_LOCKED);
                pyo3::ffi::PyGILState_Release(state);
            }
        }
    }
}

thread_local! {
    static KEPT: KeptThreadState = KeptThreadState::new();
}

/// `Python::attach`, keeping the thread state on lloyal's worker threads.
fn attach<R>(f: impl FnOnce(Python<'_>) -> R) -> R {
    if std::thread::current().name() == Some(lloyal_core::context::WORKER_THREAD_NAME) {
        KEPT.with(|_| ());
    }
    Python::attach(f)
}

/// Convert `()` to `None`.
pub fn none(py: Python<'_>, _: ()) -> PyResult<Py<PyAny>> {
    Ok(py.None())
}
