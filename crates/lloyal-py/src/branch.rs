//! `NativeBranch`: one Python object per branch, owning a core
//! [`lloyal_core::Branch`]. `lloyal.Branch` subclasses it: the reads are
//! typed getters here, the verbs Python wraps (coroutines, argument
//! checks, examples) are the `_`-named methods. Dropping an unpruned one
//! gives its lease back, with a `ResourceWarning` like an unclosed file.
//!
//! A branch made natively (a fork, a restore, a token tree's leaf) comes
//! out as a [`BranchSeed`]; `lloyal.Branch(seed, ...)` gives it its object.
//! Every object is in its context's [`Registry`], weakly, so `parent` and
//! `children` return the objects the caller holds.

use std::sync::{Arc, Mutex};

use lloyal_core::{Base, Branch, BranchId, Grammar, Reply};
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::{PyResourceWarning, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple, PyWeakrefReference};

use crate::arrays::f32_slice;
use crate::errors::IntoPyResult;
use crate::grammar::PyGrammar;
use crate::registry::Registry;
use crate::reply::{none, py_reply};
use crate::sampling::{params_from_py, PySamplingParams};

/// A branch on its way to a Python object; what a reply carries.
pub struct Seedling(pub Branch, pub Arc<Registry>);

/// A branch without its object yet: `lloyal.Branch(seed, ...)` takes it.
/// Dropped unused, the branch is freed.
#[pyclass(module = "lloyal._lloyal", frozen)]
pub struct BranchSeed(Mutex<Option<Seedling>>);

pub fn seed(py: Python<'_>, s: Seedling) -> PyResult<Py<PyAny>> {
    Ok(Py::new(py, BranchSeed(Mutex::new(Some(s))))?.into_any())
}

#[pyclass(
    name = "NativeBranch",
    module = "lloyal._lloyal",
    frozen,
    weakref,
    subclass
)]
pub struct PyBranch {
    pub(crate) inner: Branch,
    objects: Arc<Registry>,
}

impl PyBranch {
    pub fn id(&self) -> BranchId {
        self.inner.id()
    }

    fn objects_of<'py>(
        &self,
        py: Python<'py>,
        ids: impl IntoIterator<Item = BranchId>,
    ) -> Vec<Bound<'py, PyAny>> {
        ids.into_iter()
            .filter_map(|id| self.objects.object(py, id))
            .collect()
    }
}

impl Drop for PyBranch {
    fn drop(&mut self) {
        Python::attach(|py| {
            let id = self.inner.id();
            {
                let mut objects = self.objects.lock();
                // Ours (it no longer upgrades: we are going), not a newer one's.
                if objects
                    .get(&id)
                    .is_some_and(|w| w.bind(py).upgrade().is_none())
                {
                    objects.remove(&id);
                }
            }
            if !self.inner.is_alive() {
                return;
            }
            let warned = PyErr::warn(
                py,
                &py.get_type::<PyResourceWarning>(),
                c"an unpruned lloyal.Branch was garbage-collected; its lease is given back now. \
                  Prune branches (or use `async with branch`) to free them when you choose",
                1,
            );
            if let Err(e) = warned {
                e.write_unraisable(py, None);
            }
        });
        // `inner` drops next, which frees the branch.
    }
}

type Produced<'py> = (i32, Bound<'py, PyBytes>, bool);
type TopLogprobs<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<f64>>);

/// `(token, piece bytes, is_stop)` of a produced token.
pub fn piece(model: &lloyal_core::Model, token: i32) -> lloyal_core::Result<(i32, Vec<u8>, bool)> {
    Ok((
        token,
        model.token_bytes(token, false)?,
        model.is_stop_token(token)?,
    ))
}

pub fn produced(py: Python<'_>, (token, bytes, stop): (i32, Vec<u8>, bool)) -> PyResult<Py<PyAny>> {
    Ok((token, PyBytes::new(py, &bytes), stop)
        .into_pyobject(py)?
        .into_any()
        .unbind())
}

fn state_bytes(py: Python<'_>, data: Vec<u8>) -> PyResult<Py<PyAny>> {
    Ok(PyBytes::new(py, &data).into_any().unbind())
}

#[pymethods]
impl PyBranch {
    /// Take the branch out of `seed` (the other arguments are the
    /// subclass's).
    #[new]
    #[pyo3(signature = (seed, *_args, **_kwargs))]
    fn new(
        seed: &BranchSeed,
        _args: &Bound<'_, PyTuple>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let taken = seed.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Seedling(inner, objects) =
            taken.ok_or_else(|| PyValueError::new_err("this BranchSeed has its object already"))?;
        Ok(Self { inner, objects })
    }

    /// Make this the object `parent` and `children` return for the branch.
    fn _register(slf: &Bound<'_, Self>) -> PyResult<()> {
        let weak = PyWeakrefReference::new(slf)?.unbind();
        let this = slf.get();
        this.objects.lock().insert(this.id(), weak);
        Ok(())
    }

    /// The branch's id as an integer (what travels in bytes; debugging).
    #[getter]
    fn _id(&self) -> u64 {
        self.id().to_bits()
    }

    /// Tokens in this branch's KV (the next position it decodes at).
    #[getter]
    fn position(&self) -> PyResult<i32> {
        self.inner.read(|b| b.position).py_err()
    }

    /// The position this branch was forked at (0 for a root).
    #[getter]
    fn fork_head(&self) -> PyResult<i32> {
        self.inner.read(|b| b.fork_head).py_err()
    }

    /// Perplexity of accepted tokens under the model's raw distribution.
    #[getter]
    fn perplexity(&self) -> PyResult<f64> {
        self.inner.read(|b| b.perplexity.perplexity()).py_err()
    }

    /// Perplexity of accepted tokens under the sampling distribution
    /// (after filters and temperature); ``inf`` if a token outside it was
    /// forced.
    #[getter]
    fn sampling_perplexity(&self) -> PyResult<f64> {
        self.inner
            .read(|b| b.sampling_perplexity.perplexity())
            .py_err()
    }

    /// The branch this one was forked from (``None`` for a root).
    #[getter]
    fn parent<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let parent = self.inner.parent().py_err()?;
        Ok(parent.and_then(|id| self.objects.object(py, id)))
    }

    /// The branches forked from this one and not pruned, oldest first.
    #[getter]
    fn children<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let ids = self.inner.read(|b| b.children.clone()).py_err()?;
        Ok(self.objects_of(py, ids))
    }

    #[getter]
    fn is_leaf(&self) -> PyResult<bool> {
        self.inner.read(|b| b.children.is_empty()).py_err()
    }

    /// Whether the branch is gone (pruned, or its context closed).
    #[getter]
    fn disposed(&self) -> bool {
        !self.inner.is_alive()
    }

    /// Whether the branch holds a KV lease (it does until pruned).
    #[getter]
    fn is_active(&self) -> bool {
        self.inner.is_alive()
    }

    /// Whether an operation on the branch is in flight.
    #[getter]
    fn _busy(&self) -> PyResult<bool> {
        self.inner.read(|b| b.is_busy()).py_err()
    }

    #[getter]
    fn has_grammar(&self) -> PyResult<bool> {
        self.inner.read(|b| b.grammar().is_some()).py_err()
    }

    /// ``None`` unless the branch has a lazy grammar; then whether its
    /// trigger has appeared (the grammar constrains from there on).
    #[getter]
    fn grammar_triggered(&self) -> PyResult<Option<bool>> {
        self.inner
            .read(|b| b.grammar().and_then(Grammar::triggered))
            .py_err()
    }

    /// Whether the branch's grammar would accept a stop token now
    /// (``None`` without a grammar).
    #[getter]
    fn grammar_accepting(&self) -> PyResult<Option<bool>> {
        self.inner
            .with(|b| Ok(b.grammar_mut().map(Grammar::is_accepting)))
            .py_err()
    }

    #[getter]
    fn sampler_params(&self) -> PyResult<PySamplingParams> {
        let inner = self.inner.read(|b| b.sampler().params().clone()).py_err()?;
        Ok(PySamplingParams { inner })
    }

    /// A read-only copy of the logits sampling starts from.
    #[getter]
    fn logits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let logits = self.inner.with(|b| Ok(b.logits()?.clone())).py_err()?;
        let arr = PyArray1::from_slice(py, &logits);
        read_only(arr.as_any())?;
        Ok(arr)
    }

    /// Use new sampling parameters. Returns ``False`` (and changes nothing)
    /// when they equal the current ones. A change keeps the penalty
    /// history; the random stream restarts only when the seed changes.
    fn set_sampler_params(&self, params: &Bound<'_, PyAny>) -> PyResult<bool> {
        self.inner.set_params(params_from_py(params)?).py_err()
    }

    /// Restart this branch's random stream from ``seed``.
    fn reseed_sampler(&self, seed: u64) -> PyResult<()> {
        self.inner.reseed(seed).py_err()
    }

    /// Entropy of the model's next-token distribution (the raw logits
    /// snapshot: no bias, penalties or grammar).
    #[pyo3(signature = (base="nats"))]
    fn model_entropy(&self, py: Python<'_>, base: &str) -> PyResult<f64> {
        let base: Base = base.parse().py_err()?;
        let view = self.inner.logits_view().py_err()?;
        py.detach(move || view.entropy(base)).py_err()
    }

    /// A fork as a seed: ``root`` leaves it out of this branch's children,
    /// ``clone_logits=False`` leaves it without logits.
    fn _fork(
        &self,
        py: Python<'_>,
        at: Option<i32>,
        root: bool,
        clone_logits: bool,
    ) -> PyResult<Py<PyAny>> {
        let child = self.inner.fork(at).py_err()?;
        if root {
            child.detach().py_err()?;
        }
        if !clone_logits {
            child.clear_logits().py_err()?;
        }
        seed(py, Seedling(child, Arc::clone(&self.objects)))
    }

    /// The next token as ``(token, piece bytes, is_stop)``, sampled here;
    /// ``None`` for a sampler slow enough to run off the event loop (then
    /// call ``_produce_later``), unless ``inline``.
    #[pyo3(signature = (inline=false))]
    fn _produce_now<'py>(&self, py: Python<'py>, inline: bool) -> PyResult<Option<Produced<'py>>> {
        if !inline && self.inner.produce_is_slow().py_err()? {
            return Ok(None);
        }
        let branch = &self.inner;
        let (token, bytes, stop) = py
            .detach(|| piece(branch.context().model(), branch.produce()?))
            .py_err()?;
        Ok(Some((token, PyBytes::new(py, &bytes), stop)))
    }

    /// The next token sampled on a sampler thread, completing ``done``
    /// with ``(token, piece bytes, is_stop)``.
    fn _produce_later(&self, done: Py<PyAny>) {
        let model = Arc::clone(self.inner.context().model());
        let out = py_reply(done, produced);
        self.inner
            .produce_off_thread(Reply::new(move |r: lloyal_core::Result<i32>| {
                out.send(r.and_then(|token| piece(&model, token)))
            }));
    }

    fn _accept(&self, token: i32) -> PyResult<()> {
        self.inner.accept(token).py_err()
    }

    fn _truncate(
        &self,
        position: i32,
        logits: Option<PyReadonlyArray1<'_, f32>>,
        done: Py<PyAny>,
    ) -> PyResult<()> {
        let logits = logits
            .as_ref()
            .map(f32_slice)
            .transpose()?
            .map(<[f32]>::to_vec);
        self.inner.truncate(position, logits, py_reply(done, none));
        Ok(())
    }

    fn _clear_and_reseed(&self, sinks: Vec<i32>, tail: Vec<i32>, done: Py<PyAny>) {
        self.inner
            .clear_and_reseed(sinks, tail, py_reply(done, none));
    }

    /// Every position's logits of the last ``all_rows`` prefill, as a
    /// read-only ``(n, vocab)`` array (``None`` once taken).
    fn _take_rows<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyArray2<f32>>>> {
        let Some(rows) = self.inner.take_rows().py_err()? else {
            return Ok(None);
        };
        let vocab = self.inner.context().model().vocab_size().max(1) as usize;
        let n = rows.len() / vocab;
        let arr = PyArray1::from_vec(py, rows).reshape([n, vocab])?;
        read_only(arr.as_any())?;
        Ok(Some(arr))
    }

    fn _save(&self, done: Py<PyAny>) {
        self.inner.save(py_reply(done, state_bytes));
    }

    /// Prune at once if the worker is idle: ``False`` means it is busy
    /// (then call ``_prune``).
    fn _prune_now(&self, cascade: bool) -> PyResult<bool> {
        self.inner
            .prune_now(cascade)
            .transpose()
            .map(|r| r.is_some())
            .py_err()
    }

    fn _prune(&self, cascade: bool, done: Py<PyAny>) {
        self.inner.prune(cascade, py_reply(done, none));
    }

    fn _sampler_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let state = self.inner.sampler_state().py_err()?;
        Ok(PyBytes::new(py, &state))
    }

    fn _set_sampler_state(&self, state: &[u8]) -> PyResult<()> {
        self.inner.set_sampler_state(state).py_err()
    }

    /// Give the branch a copy of `grammar` (or none).
    #[pyo3(signature = (grammar=None))]
    fn _set_grammar(&self, grammar: Option<&PyGrammar>) -> PyResult<()> {
        let grammar = grammar.map(|g| g.lock().clone());
        self.inner.set_grammar(grammar).py_err()
    }

    fn _set_logits(&self, logits: PyReadonlyArray1<'_, f32>) -> PyResult<()> {
        self.inner.set_logits(f32_slice(&logits)?).py_err()
    }

    fn _set_logit_bias(&self, biases: Vec<(i32, f32)>) -> PyResult<()> {
        self.inner.set_logit_bias(biases).py_err()
    }

    fn _steer(&self, biases: Vec<(i32, f32)>) -> PyResult<()> {
        self.inner.steer(biases).py_err()
    }

    /// ``(tokens, logprobs)``: the ``k`` most likely next tokens, best first.
    fn _top_logprobs<'py>(&self, py: Python<'py>, k: usize) -> PyResult<TopLogprobs<'py>> {
        let view = self.inner.logits_view().py_err()?;
        let top = py.detach(move || view.top_logprobs(k)).py_err()?;
        let (tokens, logprobs): (Vec<i32>, Vec<f64>) = top.into_iter().unzip();
        Ok((
            PyArray1::from_vec(py, tokens),
            PyArray1::from_vec(py, logprobs),
        ))
    }

    fn _logprobs<'py>(
        &self,
        py: Python<'py>,
        tokens: Vec<i32>,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        self.inner
            .context()
            .model()
            .check_tokens(&tokens)
            .py_err()?;
        let view = self.inner.logits_view().py_err()?;
        Ok(PyArray1::from_vec(py, view.logprobs(&tokens).py_err()?))
    }

    fn _surprisal(&self, token: i32, base: &str) -> PyResult<f64> {
        let base: Base = base.parse().py_err()?;
        self.inner.context().model().check_token(token).py_err()?;
        self.inner.with(|b| b.model_surprisal(token, base)).py_err()
    }
}

/// Mark a numpy array read-only.
fn read_only(arr: &Bound<'_, PyAny>) -> PyResult<()> {
    let kwargs = PyDict::new(arr.py());
    kwargs.set_item("write", false)?;
    arr.call_method("setflags", (), Some(&kwargs))?;
    Ok(())
}
