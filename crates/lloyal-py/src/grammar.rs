//! `lloyal._lloyal.NativeGrammar`: a grammar matcher handle for the flat
//! loop, and grammar creation on `NativeContext`. The matcher itself is
//! `lloyal_core::Grammar`.

use std::sync::{Mutex, MutexGuard};

use lloyal_core::{Grammar, GrammarSpec};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::context::PyContext;
use crate::errors::IntoPyResult;

#[pyclass(name = "NativeGrammar", module = "lloyal._lloyal", frozen)]
pub struct PyGrammar {
    inner: Mutex<Grammar>,
}

impl PyGrammar {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Grammar> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn spec(kind: &str, text: String) -> PyResult<GrammarSpec> {
    Ok(match kind {
        "gbnf" => GrammarSpec::Gbnf(text),
        "lark" => GrammarSpec::Lark(text),
        "json_schema" => GrammarSpec::JsonSchema(text),
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown grammar kind {other:?}"
            )))
        }
    })
}

#[pymethods]
impl PyGrammar {
    fn clone_grammar(&self) -> Self {
        Self {
            inner: Mutex::new(self.lock().clone()),
        }
    }

    /// Mask `logits` in place (forbidden tokens -> -inf).
    fn apply(&self, py: Python<'_>, logits: &Bound<'_, PyArray1<f32>>) -> PyResult<()> {
        let mut view = logits.try_readwrite()?;
        let slice = view
            .as_slice_mut()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        py.detach(|| self.lock().apply(slice)).py_err()
    }

    fn allows(&self, token: i32) -> PyResult<bool> {
        self.lock().allows(token).py_err()
    }

    fn accept(&self, token: i32) -> PyResult<()> {
        self.lock().accept(token).py_err()
    }

    fn reset(&self) -> PyResult<()> {
        self.lock().reset().py_err()
    }

    fn is_accepting(&self) -> bool {
        self.lock().is_accepting()
    }

    fn is_stopped(&self) -> bool {
        self.lock().is_stopped()
    }

    /// `None` for an eager grammar; whether a lazy one has seen its trigger.
    fn triggered(&self) -> Option<bool> {
        self.lock().triggered()
    }
}

#[pymethods]
impl PyContext {
    /// Compile a grammar for this context's model (`kind`: gbnf, lark or
    /// json_schema); with `triggers`, a lazy one. The first grammar of a
    /// model also builds its token trie, so this runs without the GIL.
    #[pyo3(signature = (kind, text, triggers=None))]
    fn create_grammar(
        &self,
        py: Python<'_>,
        kind: &str,
        text: String,
        triggers: Option<Vec<String>>,
    ) -> PyResult<PyGrammar> {
        let spec = spec(kind, text)?;
        let model = self.inner.model().clone();
        let grammar = py
            .detach(move || match triggers {
                Some(words) => Grammar::lazy(&model, &spec, &words),
                None => Grammar::new(&model, &spec),
            })
            .py_err()?;
        Ok(PyGrammar {
            inner: Mutex::new(grammar),
        })
    }
}

/// llama.cpp's JSON schema to GBNF conversion.
#[pyfunction]
pub fn json_schema_to_grammar(py: Python<'_>, schema: String) -> PyResult<String> {
    py.detach(move || lloyal_core::json_schema_to_grammar(&schema))
        .py_err()
}
