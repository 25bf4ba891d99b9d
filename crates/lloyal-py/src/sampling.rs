//! Sampling parameters and the perplexity tracker, as Python sees them.

use lloyal_core::{PerplexityTracker, SamplingParams};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::IntoPyResult;

/// Read a `lloyal.SamplingParams` (or any object with the same attributes).
/// Anything else is a `TypeError` that names the parameter.
pub fn params_from_py(obj: &Bound<'_, PyAny>) -> PyResult<SamplingParams> {
    read_params(obj).map_err(|e| {
        let py = obj.py();
        if e.is_instance_of::<pyo3::exceptions::PyValueError>(py) {
            return e;
        }
        let kind = obj
            .get_type()
            .name()
            .map_or_else(|_| "?".to_owned(), |n| n.to_string());
        pyo3::exceptions::PyTypeError::new_err(format!(
            "params must be a lloyal.SamplingParams, got {kind} ({e})"
        ))
    })
}

fn read_params(obj: &Bound<'_, PyAny>) -> PyResult<SamplingParams> {
    let seed: Option<u64> = obj.getattr("seed")?.extract()?;
    let params = SamplingParams {
        temperature: obj.getattr("temperature")?.extract()?,
        top_k: obj.getattr("top_k")?.extract()?,
        top_p: obj.getattr("top_p")?.extract()?,
        min_p: obj.getattr("min_p")?.extract()?,
        typical_p: obj.getattr("typical_p")?.extract()?,
        repeat_penalty: obj.getattr("repeat_penalty")?.extract()?,
        frequency_penalty: obj.getattr("frequency_penalty")?.extract()?,
        presence_penalty: obj.getattr("presence_penalty")?.extract()?,
        penalty_last_n: obj.getattr("penalty_last_n")?.extract()?,
        seed,
        logit_bias: obj.getattr("logit_bias")?.extract()?,
        top_n_sigma: obj.getattr("top_n_sigma")?.extract()?,
        xtc_probability: obj.getattr("xtc_probability")?.extract()?,
        xtc_threshold: obj.getattr("xtc_threshold")?.extract()?,
        mirostat: obj.getattr("mirostat")?.extract()?,
        mirostat_tau: obj.getattr("mirostat_tau")?.extract()?,
        mirostat_eta: obj.getattr("mirostat_eta")?.extract()?,
        dry_multiplier: obj.getattr("dry_multiplier")?.extract()?,
        dry_base: obj.getattr("dry_base")?.extract()?,
        dry_allowed_length: obj.getattr("dry_allowed_length")?.extract()?,
        dry_penalty_last_n: obj.getattr("dry_penalty_last_n")?.extract()?,
        dry_sequence_breakers: obj.getattr("dry_sequence_breakers")?.extract()?,
    };
    params.validate().py_err()?;
    Ok(params)
}

/// The inverse of [`params_from_py`]: keyword arguments for `lloyal.SamplingParams`.
pub fn params_to_dict<'py>(py: Python<'py>, p: &SamplingParams) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("temperature", p.temperature)?;
    d.set_item("top_k", p.top_k)?;
    d.set_item("top_p", p.top_p)?;
    d.set_item("min_p", p.min_p)?;
    d.set_item("typical_p", p.typical_p)?;
    d.set_item("repeat_penalty", p.repeat_penalty)?;
    d.set_item("frequency_penalty", p.frequency_penalty)?;
    d.set_item("presence_penalty", p.presence_penalty)?;
    d.set_item("penalty_last_n", p.penalty_last_n)?;
    d.set_item("seed", p.seed)?;
    d.set_item("logit_bias", p.logit_bias.clone())?;
    d.set_item("top_n_sigma", p.top_n_sigma)?;
    d.set_item("xtc_probability", p.xtc_probability)?;
    d.set_item("xtc_threshold", p.xtc_threshold)?;
    d.set_item("mirostat", p.mirostat)?;
    d.set_item("mirostat_tau", p.mirostat_tau)?;
    d.set_item("mirostat_eta", p.mirostat_eta)?;
    d.set_item("dry_multiplier", p.dry_multiplier)?;
    d.set_item("dry_base", p.dry_base)?;
    d.set_item("dry_allowed_length", p.dry_allowed_length)?;
    d.set_item("dry_penalty_last_n", p.dry_penalty_last_n)?;
    d.set_item("dry_sequence_breakers", p.dry_sequence_breakers.clone())?;
    Ok(d)
}

/// Native half of `lloyal.PerplexityTracker`.
#[pyclass(name = "PerplexityTracker", module = "lloyal")]
#[derive(Clone, Default)]
pub struct PyPerplexityTracker {
    inner: PerplexityTracker,
}

#[pymethods]
impl PyPerplexityTracker {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Add one surprisal value, in nats.
    fn add(&mut self, surprisal: f64) -> PyResult<()> {
        self.inner.add(surprisal).py_err()
    }

    /// exp(mean surprisal); ``inf`` before the first ``add``.
    #[getter]
    fn perplexity(&self) -> f64 {
        self.inner.perplexity()
    }

    #[getter]
    fn count(&self) -> u64 {
        self.inner.count()
    }

    fn clone(&self) -> Self {
        Clone::clone(self)
    }

    fn reset(&mut self) {
        self.inner.reset();
    }

    fn __repr__(&self) -> String {
        format!(
            "PerplexityTracker(perplexity={:.4}, count={})",
            self.inner.perplexity(),
            self.inner.count()
        )
    }
}
