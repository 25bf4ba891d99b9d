//! Completing Python awaitables from the worker thread.
//!
//! Every asynchronous native call takes a `done` object: either a plain
//! `done(error, value)` callable, or a [`Completion`] that pairs such a
//! callable with the write end of a pipe the event loop watches. The worker
//! calls the callable holding the GIL (it only records the result), then
//! releases the GIL and writes one byte to the pipe, so the event loop
//! thread wakes to a free GIL instead of waiting for the worker to let go
//! of it. The Python side is `lloyal/_bridge.py`.

use std::io::Write;
use std::mem::ManuallyDrop;
use std::os::fd::{FromRawFd, RawFd};

use lloyal_core::Reply;
use pyo3::prelude::*;

use crate::errors::to_pyerr;

/// A result callback plus the pipe to poke once it has run.
#[pyclass(module = "lloyal._lloyal", frozen)]
pub struct Completion {
    callback: Py<PyAny>,
    wake_fd: RawFd,
    /// The object that owns `wake_fd`: it must outlive the write, so the fd
    /// cannot be closed (and its number reused) before we poke it.
    _owner: Py<PyAny>,
}

#[pymethods]
impl Completion {
    /// `owner.wake_fd` is the non-blocking write end of a pipe that `owner`
    /// keeps open for as long as it lives.
    #[new]
    fn new(callback: Py<PyAny>, owner: Bound<'_, PyAny>) -> PyResult<Self> {
        let wake_fd: RawFd = owner.getattr("wake_fd")?.extract()?;
        Ok(Self {
            callback,
            wake_fd,
            _owner: owner.unbind(),
        })
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
    let wake_fd = Python::attach(|py| {
        let args = match result.map_err(to_pyerr).and_then(|v| convert(py, v)) {
            Ok(value) => (py.None(), value),
            Err(err) => (err.into_value(py).into_any(), py.None()),
        };
        let (callback, wake_fd) = match done.cast_bound::<Completion>(py) {
            Ok(c) => (c.get().callback.clone_ref(py), Some(c.get().wake_fd)),
            Err(_) => (done.clone_ref(py), None),
        };
        if let Err(err) = callback.call1(py, args) {
            err.write_unraisable(py, Some(callback.bind(py)));
        }
        wake_fd
    });
    if let Some(fd) = wake_fd {
        poke(fd);
    }
    // `done` (and so the pipe's owner) is released only now.
    drop(done);
}

/// Convert `()` to `None`.
pub fn none(py: Python<'_>, _: ()) -> PyResult<Py<PyAny>> {
    Ok(py.None())
}
