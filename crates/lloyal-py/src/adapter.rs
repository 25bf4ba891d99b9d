//! `Lora`, `ControlVector` and the adapter-set methods of `NativeContext`
//! and `NativeBranch`. Conversions only; see `lloyal_core::adapter`.

use std::path::PathBuf;

use lloyal_core::{Adapters, ControlVector, Lora};
use numpy::PyReadonlyArray1;
use pyo3::prelude::*;

use crate::arrays::f32_slice;
use crate::branch::PyBranch;
use crate::context::PyContext;
use crate::errors::IntoPyResult;
use crate::reply::py_reply;

/// A LoRA adapter loaded into a context's model (``Context.load_lora``).
#[pyclass(name = "Lora", module = "lloyal._lloyal", frozen, eq, hash)]
pub struct PyLora {
    inner: Lora,
    path: String,
}

impl PartialEq for PyLora {
    fn eq(&self, other: &Self) -> bool {
        self.inner == other.inner
    }
}

impl std::hash::Hash for PyLora {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // What `eq` compares: the adapter (one per file and model).
        (self.inner.raw() as usize).hash(state);
    }
}

fn lora_object(py: Python<'_>, lora: Lora) -> PyResult<Py<PyAny>> {
    let path = lora.path().to_string_lossy().into_owned();
    Ok(Py::new(py, PyLora { inner: lora, path })?.into_any())
}

#[pymethods]
impl PyLora {
    /// The file it was loaded from.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// ``adapter.lora.alpha`` from the file (0.0: none).
    #[getter]
    fn alpha(&self) -> f32 {
        self.inner.alpha()
    }

    /// How many weight matrices it adapts.
    #[getter]
    fn n_pairs(&self) -> usize {
        self.inner.n_pairs()
    }

    fn __repr__(&self) -> String {
        format!(
            "Lora(path={:?}, alpha={}, n_pairs={})",
            self.path,
            self.inner.alpha(),
            self.inner.n_pairs()
        )
    }
}

/// A control vector for a context's model (``Context.control_vector``).
#[pyclass(name = "ControlVector", module = "lloyal._lloyal", frozen, eq, hash)]
pub struct PyControlVector {
    inner: ControlVector,
}

impl PartialEq for PyControlVector {
    fn eq(&self, other: &Self) -> bool {
        self.inner == other.inner
    }
}

impl std::hash::Hash for PyControlVector {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.inner.hash(state);
    }
}

#[pymethods]
impl PyControlVector {
    /// First and last layer it applies to, inclusive.
    #[getter]
    fn layers(&self) -> (i32, i32) {
        self.inner.layers()
    }

    fn __repr__(&self) -> String {
        format!("ControlVector(layers={:?})", self.inner.layers())
    }
}

type PySet = (Vec<(Py<PyLora>, f32)>, Option<Py<PyControlVector>>);

fn to_set(
    loras: Vec<PyRef<'_, PyLora>>,
    scales: Vec<f32>,
    control: Option<PyRef<'_, PyControlVector>>,
) -> Adapters {
    Adapters {
        loras: loras.iter().map(|l| l.inner.clone()).zip(scales).collect(),
        control: control.map(|c| c.inner.clone()),
    }
}

fn from_set(py: Python<'_>, set: Adapters) -> PyResult<PySet> {
    let loras = set
        .loras
        .into_iter()
        .map(|(lora, scale)| {
            let path = lora.path().to_string_lossy().into_owned();
            Ok((Py::new(py, PyLora { inner: lora, path })?, scale))
        })
        .collect::<PyResult<Vec<_>>>()?;
    let control = set
        .control
        .map(|inner| Py::new(py, PyControlVector { inner }))
        .transpose()?;
    Ok((loras, control))
}

#[pymethods]
impl PyContext {
    /// Load a LoRA file on the worker; ``done(error, lora)``.
    fn load_lora(&self, path: PathBuf, done: Py<PyAny>) {
        self.inner.load_lora(path, py_reply(done, lora_object));
    }

    /// A control vector from ``n_layer * n_embd`` floats (row 0 zero).
    #[pyo3(signature = (directions, scale, layers))]
    fn control_vector(
        &self,
        directions: PyReadonlyArray1<'_, f32>,
        scale: f32,
        layers: Option<(i32, i32)>,
    ) -> PyResult<PyControlVector> {
        let data = f32_slice(&directions)?;
        let inner = ControlVector::new(self.inner.model(), data, scale, layers).py_err()?;
        Ok(PyControlVector { inner })
    }

    /// Read a control vector file (GIL released meanwhile).
    #[pyo3(signature = (path, scale, layers))]
    fn load_control_vector(
        &self,
        py: Python<'_>,
        path: PathBuf,
        scale: f32,
        layers: Option<(i32, i32)>,
    ) -> PyResult<PyControlVector> {
        let model = std::sync::Arc::clone(self.inner.model());
        let inner = py
            .detach(move || ControlVector::load(&model, path, scale, layers))
            .py_err()?;
        Ok(PyControlVector { inner })
    }

    fn set_default_adapters(
        &self,
        loras: Vec<PyRef<'_, PyLora>>,
        scales: Vec<f32>,
        control: Option<PyRef<'_, PyControlVector>>,
    ) -> PyResult<()> {
        self.inner
            .set_default_adapters(to_set(loras, scales, control))
            .py_err()
    }

    fn default_adapters(&self, py: Python<'_>) -> PyResult<PySet> {
        from_set(py, self.inner.default_adapters())
    }
}

#[pymethods]
impl PyBranch {
    fn _set_adapters(
        &self,
        loras: Vec<PyRef<'_, PyLora>>,
        scales: Vec<f32>,
        control: Option<PyRef<'_, PyControlVector>>,
    ) -> PyResult<()> {
        self.inner
            .set_adapters(to_set(loras, scales, control))
            .py_err()
    }

    /// The branch's adapter set: ``([(lora, scale), ...], control)``.
    #[getter]
    fn _adapters(&self, py: Python<'_>) -> PyResult<PySet> {
        let set = self.inner.read(|b| b.adapters().clone()).py_err()?;
        from_set(py, set)
    }
}
