//! Completing Python awaitables from the worker thread.
//!
//! Every asynchronous native call takes a `done` object: either a plain
//! `done(error, value)` callable (trio), or a [`Completion`]: an asyncio
//! future plus the [`ResultQueue`] of its event loop.
//!
//! For a `Completion` the worker never takes the GIL: it appends the Rust
//! result to the queue and writes one byte to the queue's socket pair (a
//! Unix socket pair, or a loopback TCP pair on Windows: what every event
//! loop that can watch a handle can watch there). The event loop watches
//! the read end with [`ResultQueue::settle`] as its reader callback, which converts every queued result to Python objects
//! and settles the futures, one wake-up for whatever arrived meanwhile.
//! So the worker cannot stall behind a busy event loop's GIL, and the
//! loop runs no Python frame of ours to settle a batch. The Python side is
//! `lloyal/_bridge.py`.
//!
//! A callable `done` is called with the GIL on the worker. Worker threads
//! keep their Python thread state between such replies (see [`attach`]):
//! creating and destroying one per reply costs tens of microseconds.

use std::io::{Read, Write};
use std::sync::{Arc, Mutex, MutexGuard};

use lloyal_core::Reply;
use pyo3::intern;
use pyo3::prelude::*;

use crate::errors::to_pyerr;

/// A finished call's result, turned into `(error, value)` on the loop
/// thread (the conversion needs the GIL, which the worker does not take).
type Convert = Box<dyn FnOnce(Python<'_>) -> (Py<PyAny>, Py<PyAny>) + Send>;

/// A future and the result to settle it with.
type Settle = (Py<PyAny>, Convert);

/// The two ends of the wake-up socket pair, owned from the handles Python
/// hands over (`socket.socketpair()`, then `detach()`).
#[cfg(unix)]
mod end {
    use std::os::fd::{AsRawFd, FromRawFd, RawFd};

    pub type Handle = RawFd;
    pub type End = std::os::unix::net::UnixStream;

    pub fn valid(handle: Handle) -> bool {
        handle >= 0
    }

    /// # Safety
    /// `handle` is an open socket that nothing else owns or closes.
    pub unsafe fn own(handle: Handle) -> End {
        // SAFETY: the caller's contract.
        unsafe { End::from_raw_fd(handle) }
    }

    pub fn handle(end: &End) -> Handle {
        end.as_raw_fd()
    }
}

#[cfg(windows)]
mod end {
    use std::os::windows::io::{AsRawSocket, FromRawSocket, RawSocket};

    pub type Handle = RawSocket;
    pub type End = std::net::TcpStream;

    pub fn valid(handle: Handle) -> bool {
        handle != RawSocket::MAX // INVALID_SOCKET
    }

    /// # Safety
    /// `handle` is an open socket that nothing else owns or closes.
    pub unsafe fn own(handle: Handle) -> End {
        // SAFETY: the caller's contract.
        unsafe { End::from_raw_socket(handle) }
    }

    pub fn handle(end: &End) -> Handle {
        end.as_raw_socket()
    }
}

/// What a [`ResultQueue`] shares with the replies in flight to it: they
/// keep the socket pair open until they have written to it.
struct Shared {
    /// `(future, its result)`, oldest first.
    items: Mutex<Vec<Settle>>,
    read: end::End,
    write: end::End,
}

impl Shared {
    fn items(&self) -> MutexGuard<'_, Vec<Settle>> {
        // Pushing and taking cannot leave the list half-written.
        self.items.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queue results, then poke the socket once: pushed before poked, so
    /// the wake-up a poke causes finds every result queued before it.
    fn push_all(&self, results: impl IntoIterator<Item = Settle>) {
        self.items().extend(results);
        // A full socket buffer (`EAGAIN`) already guarantees a wake-up.
        let _ = (&self.write).write(&[1]);
    }
}

/// Finished calls of one event loop, and the socket pair that wakes it.
#[pyclass(module = "lloyal._lloyal", frozen)]
pub struct ResultQueue {
    shared: Arc<Shared>,
}

#[pymethods]
impl ResultQueue {
    /// Takes ownership of a connected socket pair's two non-blocking ends
    /// (file descriptors, or socket handles on Windows); they are closed
    /// when the queue and every reply in flight to it are gone.
    #[new]
    fn new(read_fd: end::Handle, wake_fd: end::Handle) -> PyResult<Self> {
        if !end::valid(read_fd) || !end::valid(wake_fd) || read_fd == wake_fd {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "ResultQueue needs the two distinct ends of a socket pair",
            ));
        }
        // SAFETY: the caller hands both sockets over (`_LoopWaker` detaches
        // them from their Python objects); each is owned once.
        let (read, write) = unsafe { (end::own(read_fd), end::own(wake_fd)) };
        Ok(Self {
            shared: Arc::new(Shared {
                items: Mutex::new(Vec::new()),
                read,
                write,
            }),
        })
    }

    /// The read end, for the event loop to watch.
    #[getter]
    fn read_fd(&self) -> end::Handle {
        end::handle(&self.shared.read)
    }

    /// Whether results are queued: a call answered while it was being made
    /// (a validation error, a greedy produce, a job run on the caller's
    /// thread) is settled at once by `call_native`, without waiting for the
    /// loop to see the socket.
    #[getter]
    fn pending(&self) -> bool {
        !self.shared.items().is_empty()
    }

    /// Settle every queued future with its result, oldest first (a future
    /// already done -- cancelled while the worker ran -- is skipped). The
    /// event loop's reader callback for [`Self::read_fd`].
    fn settle(&self, py: Python<'_>) {
        // Read the pokes before taking the results: a result is queued
        // before its poke, so none is left behind. More than 4096 pokes
        // leave the socket readable, and the loop calls us again.
        let _ = (&self.shared.read).read(&mut [0u8; 4096]);
        let items = std::mem::take(&mut *self.shared.items());
        for (fut, convert) in items {
            let (error, value) = convert(py);
            if let Err(err) = settle(fut.bind(py), error, value) {
                err.write_unraisable(py, Some(fut.bind(py)));
            }
        }
    }
}

/// `fut.set_exception(error)` or `fut.set_result(value)`, unless `fut` is
/// already done.
fn settle(fut: &Bound<'_, PyAny>, error: Py<PyAny>, value: Py<PyAny>) -> PyResult<()> {
    let py = fut.py();
    if fut.call_method0(intern!(py, "done"))?.is_truthy()? {
        return Ok(());
    }
    if error.is_none(py) {
        fut.call_method1(intern!(py, "set_result"), (value,))?;
    } else {
        fut.call_method1(intern!(py, "set_exception"), (error,))?;
    }
    Ok(())
}

/// Where one call's result goes: `target` (an asyncio future) is queued
/// with its result on `queue`, whose loop settles it.
#[pyclass(module = "lloyal._lloyal", frozen)]
pub struct Completion {
    target: Py<PyAny>,
    queue: Py<ResultQueue>,
}

#[pymethods]
impl Completion {
    #[new]
    fn new(target: Py<PyAny>, queue: Py<ResultQueue>) -> Self {
        Self { target, queue }
    }
}

/// `(error, value)` for `result`, `value` converted with `convert`.
fn to_python<T>(
    py: Python<'_>,
    result: lloyal_core::Result<T>,
    convert: fn(Python<'_>, T) -> PyResult<Py<PyAny>>,
) -> (Py<PyAny>, Py<PyAny>) {
    match result.map_err(to_pyerr).and_then(|v| convert(py, v)) {
        Ok(value) => (py.None(), value),
        Err(err) => (err.into_value(py).into_any(), py.None()),
    }
}

/// Wrap `done` as an engine reply, converting the value with `convert`.
/// Call with the GIL held (from a bound method).
pub fn py_reply<T: Send + 'static>(
    done: Py<PyAny>,
    convert: fn(Python<'_>, T) -> PyResult<Py<PyAny>>,
) -> Reply<T> {
    let to_loop = Python::attach(|py| {
        done.cast_bound::<Completion>(py).ok().map(|c| {
            let c = c.get();
            (c.target.clone_ref(py), Arc::clone(&c.queue.get().shared))
        })
    });
    match to_loop {
        // `done` is let go of here, with the GIL: the reply must not hold
        // it, since dropping a Python object on the worker (no GIL) defers
        // its release to whenever Python next runs our code -- maybe never,
        // which kept a finished future, and the context it held, alive at
        // exit. The future itself is dropped by `settle`, with the GIL.
        Some((fut, queue)) => {
            drop(done);
            Reply::new(move |result| {
                let convert: Convert = Box::new(move |py| to_python(py, result, convert));
                // No GIL here. The socket pair stays open while `queue` is held.
                send_later(Out::Loop(queue, fut, convert));
            })
        }
        None => Reply::new(move |result| {
            let convert: Convert = Box::new(move |py| to_python(py, result, convert));
            send_later(Out::Call(done, convert));
        }),
    }
}

/// Where a finished call's result goes.
enum Out {
    /// An asyncio future, through its loop's queue.
    Loop(Arc<Shared>, Py<PyAny>, Convert),
    /// A callable `done` (trio; loops that cannot watch a socket).
    Call(Py<PyAny>, Convert),
}

thread_local! {
    /// Results of the replies of the job running on this thread.
    static OUTBOX: std::cell::RefCell<Vec<Out>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Hand a result on together with the other replies of the same job: the
/// first one defers a flush until the job is over (`after_job`; at once
/// off the worker). The flush gives each loop's queue its results under one
/// lock and one poke, and hands every callable `done` to
/// `lloyal._bridge._deliver` in one call, which wakes each trio run once.
/// So the tasks a merged decode answers all run in the same loop round and
/// their next commits merge again; one by one, a loop woken by the first
/// result would run that task a round ahead of the others.
fn send_later(out: Out) {
    let first = OUTBOX.with(|o| {
        let mut o = o.borrow_mut();
        o.push(out);
        o.len() == 1
    });
    if first {
        lloyal_core::after_job(Box::new(flush));
    }
}

fn flush() {
    let outbox = OUTBOX.with(|o| std::mem::take(&mut *o.borrow_mut()));
    let mut queues: Vec<(Arc<Shared>, Vec<Settle>)> = Vec::new();
    let mut calls = Vec::new();
    for out in outbox {
        match out {
            Out::Loop(queue, fut, convert) => {
                match queues.iter_mut().find(|(q, _)| Arc::ptr_eq(q, &queue)) {
                    Some((_, items)) => items.push((fut, convert)),
                    None => queues.push((queue, vec![(fut, convert)])),
                }
            }
            Out::Call(done, convert) => calls.push((done, convert)),
        }
    }
    for (queue, items) in queues {
        queue.push_all(items);
    }
    if calls.is_empty() {
        return;
    }
    attach(|py| {
        let items: Vec<(Py<PyAny>, Py<PyAny>, Py<PyAny>)> = calls
            .into_iter()
            .map(|(done, convert)| {
                let (error, value) = convert(py);
                (done, error, value)
            })
            .collect();
        let delivered = py
            .import(intern!(py, "lloyal._bridge"))
            .and_then(|m| m.getattr(intern!(py, "_deliver")))
            .and_then(|deliver| deliver.call1((items,)));
        if let Err(err) = delivered {
            err.write_unraisable(py, None);
        }
    });
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
    if std::thread::current().name() == Some(lloyal_core::WORKER_THREAD_NAME) {
        KEPT.with(|_| ());
    }
    Python::attach(f)
}

/// Convert `()` to `None`.
pub fn none(py: Python<'_>, _: ()) -> PyResult<Py<PyAny>> {
    Ok(py.None())
}
