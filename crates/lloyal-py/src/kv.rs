//! KV cache methods of `NativeContext` (engine: `lloyal_core::flat::kv`).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::context::PyContext;
use crate::errors::IntoPyResult;
use crate::reply::{none, py_reply};

fn bytes(py: Python<'_>, data: Vec<u8>) -> PyResult<Py<PyAny>> {
    Ok(PyBytes::new(py, &data).into_any().unbind())
}

fn tokens(py: Python<'_>, tokens: Vec<i32>) -> PyResult<Py<PyAny>> {
    Ok(tokens.into_pyobject(py)?.into_any().unbind())
}

#[pymethods]
impl PyContext {
    fn kv_cache_size(&self, seq_id: i32) -> PyResult<i32> {
        self.inner.kv_cache_size(seq_id).py_err()
    }

    fn kv_cache_remove(&self, seq_id: i32, start: i32, end: i32, done: Py<PyAny>) {
        self.inner
            .kv_cache_remove(seq_id, start, end, py_reply(done, none));
    }

    fn kv_seq_copy(&self, src: i32, dst: i32) -> PyResult<()> {
        self.inner.kv_seq_copy(src, dst).py_err()
    }

    fn kv_seq_keep(&self, seq_id: i32) -> PyResult<()> {
        self.inner.kv_seq_keep(seq_id).py_err()
    }

    fn kv_cache_clear(&self, done: Py<PyAny>) {
        self.inner.kv_cache_clear(py_reply(done, none));
    }

    fn kv_cache_save(&self, seq_id: i32, tokens_held: Vec<i32>, done: Py<PyAny>) {
        self.inner
            .kv_cache_save(seq_id, tokens_held, py_reply(done, bytes));
    }

    fn kv_cache_load(&self, seq_id: i32, data: &[u8], done: Py<PyAny>) {
        self.inner
            .kv_cache_load(seq_id, data.to_vec(), py_reply(done, tokens));
    }

    fn clear_and_reseed(&self, seq_id: i32, sinks: Vec<i32>, tail: Vec<i32>, done: Py<PyAny>) {
        self.inner
            .clear_and_reseed(seq_id, sinks, tail, py_reply(done, none));
    }
}
