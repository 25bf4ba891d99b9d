//! numpy arrays as the slices the core takes.

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;

/// A contiguous float32 array as a slice (the Python side makes it contiguous).
pub(crate) fn f32_slice<'a>(a: &'a PyReadonlyArray1<'_, f32>) -> PyResult<&'a [f32]> {
    a.as_slice()
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
}
