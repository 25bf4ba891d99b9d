//! Completing Python awaitables from the worker thread.
//!
//! Every asynchronous native call takes a `done(error, value)` callable. The
//! worker calls it once, holding the GIL only for that call; the Python side
//! (`lloyal/_bridge.py`) turns it into an asyncio future or a trio wake-up.

use lloyal_core::Reply;
use pyo3::prelude::*;

use crate::errors::to_pyerr;

/// Wrap `done` as an engine reply, converting the value with `convert`.
pub fn py_reply<T: Send + 'static>(
    done: Py<PyAny>,
    convert: fn(Python<'_>, T) -> PyResult<Py<PyAny>>,
) -> Reply<T> {
    Box::new(move |result| {
        Python::attach(|py| {
            let args = match result.map_err(to_pyerr).and_then(|v| convert(py, v)) {
                Ok(value) => (py.None(), value),
                Err(err) => (err.into_value(py).into_any(), py.None()),
            };
            if let Err(err) = done.call1(py, args) {
                err.write_unraisable(py, Some(done.bind(py)));
            }
        });
    })
}

/// Convert `()` to `None`.
pub fn none(py: Python<'_>, _: ()) -> PyResult<Py<PyAny>> {
    Ok(py.None())
}
