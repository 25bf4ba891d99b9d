//! Embedding calls on `NativeContext`; the engine side is `lloyal_core::embed`.

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;

use crate::context::PyContext;
use crate::errors::IntoPyResult;
use crate::reply::{none, py_reply};

/// One row per input, as a float32 matrix.
fn matrix(py: Python<'_>, rows: Vec<Vec<f32>>) -> PyResult<Py<PyAny>> {
    let dim = rows.first().map_or(0, Vec::len);
    let flat: Vec<f32> = rows.into_iter().flatten().collect();
    let n = flat.len().checked_div(dim).unwrap_or(0);
    Ok(PyArray1::from_vec(py, flat)
        .reshape([n, dim])?
        .into_any()
        .unbind())
}

#[pymethods]
impl PyContext {
    fn embed(&self, inputs: Vec<Vec<i32>>, done: Py<PyAny>) {
        self.inner.embed(inputs, py_reply(done, matrix));
    }

    fn encode(&self, tokens: Vec<i32>, done: Py<PyAny>) {
        self.inner.encode(tokens, py_reply(done, none));
    }

    /// The last `encode`'s embeddings: shape (1, dim) pooled, (tokens, dim) otherwise.
    fn get_embeddings<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let e = self.inner.embeddings().py_err()?;
        PyArray1::from_vec(py, e.data).reshape([e.rows, e.dim])
    }

    fn has_pooling(&self) -> bool {
        self.inner.has_pooling()
    }

    fn ranks(&self) -> bool {
        self.inner.ranks()
    }
}
