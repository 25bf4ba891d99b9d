//! The live Python object of each branch of a context, held weakly, so
//! that `parent` and `children` return the objects the caller holds.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use lloyal_core::BranchId;
use pyo3::prelude::*;
use pyo3::types::{PyWeakrefMethods, PyWeakrefReference};

/// The live object of each branch of a context, held weakly.
#[derive(Default)]
pub struct Registry(Mutex<HashMap<BranchId, Py<PyWeakrefReference>>>);

impl Registry {
    pub(crate) fn lock(&self) -> MutexGuard<'_, HashMap<BranchId, Py<PyWeakrefReference>>> {
        // An insert or remove cannot leave the map half-written.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The object of branch `id`, if it has a live one.
    pub(crate) fn object<'py>(&self, py: Python<'py>, id: BranchId) -> Option<Bound<'py, PyAny>> {
        self.lock().get(&id).and_then(|w| w.bind(py).upgrade())
    }
}
