//! Sampling parameters and the perplexity tracker, as Python sees them.

use lloyal_core::{PerplexityTracker, SamplingParams};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString, PyTuple};
use pyo3::IntoPyObjectExt;

use crate::errors::IntoPyResult;

/// How to pick the next token. Defaults are llama.cpp's. Immutable; all
/// arguments are keywords.
///
/// The chain runs logit bias, penalties, top-n-sigma, top-k, typical-p,
/// top-p, min-p, XTC, temperature, then draws from the softmax.
/// ``temperature <= 0`` is greedy (argmax after bias and penalties).
/// ``mirostat=2`` (Mirostat 2.0) replaces the filters: after temperature it
/// keeps tokens whose surprise in bits is within a bound that it steers
/// toward ``mirostat_tau`` with rate ``mirostat_eta``. ``seed=None`` seeds
/// from the OS; a fixed seed makes sampling reproducible.
///
/// ``logit_bias`` maps token ids to additive biases (a dict or pairs).
///
/// DRY (``dry_multiplier > 0``) runs after the penalties: a token that would
/// extend a repeat of ``n >= dry_allowed_length`` earlier tokens loses
/// ``dry_multiplier * dry_base ** (n - dry_allowed_length)``; tokens whose
/// text contains one of ``dry_sequence_breakers`` end a repeat.
/// ``dry_penalty_last_n=-1`` looks at the whole history.
///
/// The engine's own parameters (Rust ``lloyal_core::SamplingParams``): the
/// checks run once, here, and each call hands the engine a copy. The
/// sampler computes in ``float32``, as llama.cpp's do. Values are kept as
/// given (``float64``); biases are ``float32``.
///
/// >>> from lloyal import SamplingParams
/// >>> SamplingParams(temperature=0).is_greedy
/// True
/// >>> SamplingParams(seed=1).with_(top_k=10).top_k
/// 10
/// >>> SamplingParams(top_p=1.5)
/// Traceback (most recent call last):
///   ...
/// ValueError: top_p must be in [0, 1], got 1.5
#[pyclass(name = "SamplingParams", module = "lloyal", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PySamplingParams {
    pub(crate) inner: SamplingParams,
}

/// The engine's copy of a `lloyal.SamplingParams`; anything else is a
/// `TypeError` that names the parameter.
pub fn params_from_py(obj: &Bound<'_, PyAny>) -> PyResult<SamplingParams> {
    match obj.cast::<PySamplingParams>() {
        Ok(p) => Ok(p.get().inner.clone()),
        Err(_) => {
            let kind = obj
                .get_type()
                .name()
                .map_or_else(|_| "?".to_owned(), |n| n.to_string());
            Err(PyTypeError::new_err(format!(
                "params must be a lloyal.SamplingParams, got {kind}"
            )))
        }
    }
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

/// A float parameter: any real number but a bool.
fn real(name: &str, v: &Bound<'_, PyAny>) -> PyResult<f64> {
    let wrong = || PyTypeError::new_err(format!("{name} must be a float, got {}", type_name(v)));
    if v.is_instance_of::<PyBool>() || v.is_instance_of::<PyString>() {
        return Err(wrong());
    }
    v.extract::<f64>().map_err(|_| wrong())
}

/// An integer parameter (anything with `__index__` but a bool) that fits `T`.
fn integer<T: TryFrom<i128>>(name: &str, v: &Bound<'_, PyAny>) -> PyResult<T> {
    if v.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int, got bool"
        )));
    }
    let n: i128 = v.extract().map_err(|_| {
        PyTypeError::new_err(format!("{name} must be an int, got {}", type_name(v)))
    })?;
    T::try_from(n).map_err(|_| PyValueError::new_err(format!("{name} is out of range, got {n}")))
}

fn logit_bias(_name: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<(i32, f32)>> {
    let pairs = match v.cast::<PyDict>() {
        Ok(d) => d.items().into_any(),
        Err(_) => v.clone(),
    };
    let mut out = Vec::new();
    for pair in pairs
        .try_iter()
        .map_err(|_| PyTypeError::new_err("logit_bias must be a dict or pairs (token id, bias)"))?
    {
        let (t, b): (Bound<'_, PyAny>, Bound<'_, PyAny>) = pair?.extract().map_err(|_| {
            PyTypeError::new_err("logit_bias must be a dict or pairs (token id, bias)")
        })?;
        let t: i64 = integer("a logit_bias token id", &t)?;
        if t < 0 {
            return Err(PyValueError::new_err("logit_bias token ids must be >= 0"));
        }
        let t = i32::try_from(t).map_err(|_| {
            PyValueError::new_err(format!("logit_bias token id {t} is out of range"))
        })?;
        out.push((t, real("a logit_bias bias", &b)? as f32));
    }
    Ok(out)
}

fn breakers(_name: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    let wrong = || PyTypeError::new_err("dry_sequence_breakers must be a sequence of strings");
    if v.is_instance_of::<PyString>() {
        return Err(wrong());
    }
    v.try_iter()
        .map_err(|_| wrong())?
        .map(|b| b.and_then(|b| b.extract::<String>()).map_err(|_| wrong()))
        .collect()
}

/// `f32` bias as the decimal the user most likely wrote (0.1, not
/// 0.10000000149): the shortest text that reads back as the same `f32`.
fn shortest(x: f32) -> f64 {
    format!("{x}").parse().unwrap_or(f64::from(x))
}

/// Every field of `lloyal.SamplingParams`, in keyword order, once: its
/// name, its Rust type, how a Python value is read into it and how it is
/// given back. `$each!` receives the whole list; the constructor, the
/// getters and the keyword dict (`with_`, pickling, `repr`) are generated
/// from it. The defaults are `lloyal_core::SamplingParams::default()`'s;
/// the stub and `text_signature` are checked against them by
/// `tests/test_sampling_params.py`.
macro_rules! for_every_field {
    ($each:ident) => {
        $each! {
            temperature: f64 = real, plain;
            top_k: i32 = integer, plain;
            top_p: f64 = real, plain;
            min_p: f64 = real, plain;
            typical_p: f64 = real, plain;
            repeat_penalty: f64 = real, plain;
            frequency_penalty: f64 = real, plain;
            presence_penalty: f64 = real, plain;
            penalty_last_n: i32 = integer, plain;
            seed: Option<u64> = seed, plain;
            logit_bias: Vec<(i32, f32)> = logit_bias, bias_tuple;
            top_n_sigma: f64 = real, plain;
            xtc_probability: f64 = real, plain;
            xtc_threshold: f64 = real, plain;
            mirostat: u8 = integer, plain;
            mirostat_tau: f64 = real, plain;
            mirostat_eta: f64 = real, plain;
            dry_multiplier: f64 = real, plain;
            dry_base: f64 = real, plain;
            dry_allowed_length: i32 = integer, plain;
            dry_penalty_last_n: i32 = integer, plain;
            dry_sequence_breakers: Vec<String> = breakers, tuple;
        }
    };
}

/// `seed`: a non-negative int below 2**64 (None, the default, seeds from
/// the OS).
fn seed(name: &str, v: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    if v.is_instance_of::<PyBool>() || v.extract::<i128>().is_err() {
        return Err(PyTypeError::new_err(format!(
            "{name} must be an int or None, got {}",
            type_name(v)
        )));
    }
    let n: i128 = v.extract()?;
    u64::try_from(n)
        .map(Some)
        .map_err(|_| PyValueError::new_err(format!("{name} must be in [0, 2**64), got {n}")))
}

fn plain<'py, T: IntoPyObjectExt<'py> + Clone>(
    py: Python<'py>,
    v: &T,
) -> PyResult<Bound<'py, PyAny>> {
    v.clone().into_bound_py_any(py)
}

fn tuple<'py>(py: Python<'py>, v: &[String]) -> PyResult<Bound<'py, PyAny>> {
    Ok(PyTuple::new(py, v)?.into_any())
}

fn bias_tuple<'py>(py: Python<'py>, v: &[(i32, f32)]) -> PyResult<Bound<'py, PyAny>> {
    Ok(PyTuple::new(py, v.iter().map(|&(t, b)| (t, shortest(b))))?.into_any())
}

macro_rules! constructor_and_getters {
    ($($name:ident: $ty:ty = $read:ident, $give:ident;)*) => {
        #[pymethods]
        impl PySamplingParams {
            #[new]
            #[pyo3(
                text_signature = "(*, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, \
                typical_p=1.0, repeat_penalty=1.0, frequency_penalty=0.0, \
                presence_penalty=0.0, penalty_last_n=64, seed=None, logit_bias=(), \
                top_n_sigma=-1.0, xtc_probability=0.0, xtc_threshold=0.1, mirostat=0, \
                mirostat_tau=5.0, mirostat_eta=0.1, dry_multiplier=0.0, dry_base=1.75, \
                dry_allowed_length=2, dry_penalty_last_n=-1, \
                dry_sequence_breakers=('\\n', ':', '\"', '*'))",
                signature = (**fields)
            )]
            fn new(fields: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
                let mut p = SamplingParams::default();
                for (key, v) in fields.into_iter().flat_map(|d| d.iter()) {
                    let key: String = key.extract()?;
                    if v.is_none() {
                        continue; // the default
                    }
                    match key.as_str() {
                        $(stringify!($name) => p.$name = $read(stringify!($name), &v)?,)*
                        other => {
                            return Err(PyTypeError::new_err(format!(
                                "SamplingParams() got an unexpected keyword argument '{other}'"
                            )))
                        }
                    }
                }
                p.validate().py_err()?;
                Ok(PySamplingParams { inner: p })
            }

            $(
                #[getter]
                fn $name<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
                    $give(py, &self.inner.$name)
                }
            )*
        }

        /// Keyword arguments for `lloyal.SamplingParams`, in field order.
        pub fn params_to_dict<'py>(
            py: Python<'py>,
            p: &SamplingParams,
        ) -> PyResult<Bound<'py, PyDict>> {
            let d = PyDict::new(py);
            $(d.set_item(stringify!($name), $give(py, &p.$name)?)?;)*
            Ok(d)
        }
    };
}

for_every_field!(constructor_and_getters);

#[pymethods]
impl PySamplingParams {
    /// Whether these parameters always pick the most likely token.
    #[getter]
    fn is_greedy(&self) -> bool {
        self.inner.temperature <= 0.0 || self.inner.top_k == 1
    }

    /// A copy with some fields changed.
    #[pyo3(signature = (**changes))]
    fn with_<'py>(
        slf: &Bound<'py, Self>,
        changes: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kwargs = params_to_dict(slf.py(), &slf.get().inner)?;
        if let Some(changes) = changes {
            kwargs.update(changes.as_mapping())?;
        }
        slf.get_type().call((), Some(&kwargs))
    }

    /// Pickling and `copy`: rebuilt from its keywords.
    fn __getnewargs_ex__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyTuple>, Bound<'py, PyDict>)> {
        Ok((PyTuple::empty(py), params_to_dict(py, &self.inner)?))
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        format!("{:?}", self.inner).hash(&mut h);
        h.finish()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let d = params_to_dict(py, &self.inner)?;
        let mut parts = Vec::new();
        for (k, v) in d.iter() {
            parts.push(format!("{}={}", k.str()?, v.repr()?));
        }
        Ok(format!("SamplingParams({})", parts.join(", ")))
    }
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
