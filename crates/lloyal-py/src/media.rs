//! The media methods of `NativeContext` and `NativeBranch`. Conversions
//! only; see `lloyal_core::media`.

use std::path::PathBuf;

use lloyal_core::media::{Media, MediaLayout, ProjectorInfo};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::branch::PyBranch;
use crate::context::PyContext;
use crate::reply::py_reply;

/// `bytes` as a medium: RGB pixels when `size` is `(width, height)`, an
/// encoded file otherwise.
fn media(data: Vec<u8>, size: Option<(u32, u32)>) -> Media {
    match size {
        Some((width, height)) => Media::Rgb {
            width,
            height,
            pixels: data,
        },
        None => Media::Encoded(data),
    }
}

fn info_object(py: Python<'_>, info: ProjectorInfo) -> PyResult<Py<PyAny>> {
    let d = PyDict::new(py);
    d.set_item("vision", info.vision)?;
    d.set_item("audio", info.audio)?;
    d.set_item("audio_sample_rate", info.audio_sample_rate)?;
    Ok(d.into_any().unbind())
}

/// ``lloyal._probe``'s work, in the probe process: load the projector
/// ``mmproj`` for the model at ``model_path`` as a context would (the GIL
/// released); its info dict, or the typed error.
#[pyfunction]
pub fn probe_projector(
    py: Python<'_>,
    model_path: PathBuf,
    mmproj: PathBuf,
) -> PyResult<Py<PyAny>> {
    let info = py
        .detach(|| lloyal_core::media::probe_projector(&model_path, &mmproj))
        .map_err(crate::errors::to_pyerr)?;
    info_object(py, info)
}

fn layout_object(py: Python<'_>, layout: MediaLayout) -> PyResult<Py<PyAny>> {
    Ok((layout.positions, layout.content)
        .into_pyobject(py)?
        .into_any()
        .unbind())
}

fn int_object(py: Python<'_>, n: i32) -> PyResult<Py<PyAny>> {
    Ok(n.into_pyobject(py)?.into_any().unbind())
}

#[pymethods]
impl PyContext {
    /// Load a projector on the worker; ``done(error, info)`` with ``info``
    /// a dict of ``vision``, ``audio``, ``audio_sample_rate``.
    fn load_projector(&self, path: PathBuf, done: Py<PyAny>) {
        self.inner.load_projector(path, py_reply(done, info_object));
    }

    /// The positions a medium takes and its content hash;
    /// ``done(error, (n, hash))``.
    #[pyo3(signature = (data, size, done))]
    fn media_positions(&self, data: Vec<u8>, size: Option<(u32, u32)>, done: Py<PyAny>) {
        self.inner
            .media_positions(media(data, size), py_reply(done, layout_object));
    }

    /// The text libmtmd reads as a medium.
    #[staticmethod]
    fn media_marker() -> &'static str {
        lloyal_core::media::marker()
    }
}

#[pymethods]
impl PyBranch {
    /// Encode a medium into this branch; ``done(error, positions)``.
    #[pyo3(signature = (data, size, done))]
    fn _prefill_media(&self, data: Vec<u8>, size: Option<(u32, u32)>, done: Py<PyAny>) {
        self.inner
            .prefill_media(media(data, size), py_reply(done, int_object));
    }
}
