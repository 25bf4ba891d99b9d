//! `backend_info()`: how llama.cpp is built into this process and what it
//! chose at run time (see `lloyal_core::backend_info`).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::IntoPyResult;

/// A dict of the build and the devices; `lloyal.backend_info()` wraps it.
#[pyfunction]
pub fn backend_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let info = py.detach(lloyal_core::backend_info).py_err()?;
    let out = PyDict::new(py);
    out.set_item("llama_cpp_2_version", info.llama_cpp_2_version)?;
    out.set_item("dynamic_backends", info.dynamic_backends)?;
    out.set_item("cpu_variant", info.cpu_variant)?;
    out.set_item(
        "module_dir",
        info.module_dir.map(|d| d.to_string_lossy().into_owned()),
    )?;
    out.set_item("system_info", info.system_info)?;
    out.set_item("cpu_features", info.cpu_features)?;
    let devices = PyList::empty(py);
    for d in info.devices {
        let dev = PyDict::new(py);
        dev.set_item("name", d.name)?;
        dev.set_item("description", d.description)?;
        dev.set_item("backend", d.backend)?;
        dev.set_item("kind", d.kind)?;
        dev.set_item("memory_total", d.memory_total)?;
        dev.set_item("memory_free", d.memory_free)?;
        devices.append(dev)?;
    }
    out.set_item("devices", devices)?;
    Ok(out)
}
