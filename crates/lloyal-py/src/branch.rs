//! Branch operations on `NativeContext`. Branch handles cross into Python
//! as plain integers (`BranchId::to_bits`); `lloyal.Branch` wraps them.

use std::sync::Arc;

use lloyal_core::{Base, BranchId, Reply};
use lloyal_core::{ItemResults, StepInput, TreeOutcome};
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::context::{f32_slice, PyContext};
use crate::errors::{to_pyerr, IntoPyResult};
use crate::reply::{none, py_reply};
use crate::sampling::{params_from_py, PySamplingParams};

/// `(tokens, logprobs)` of `branch_top_logprobs`.
/// `(logprob, top tokens, their logprobs)` of one branch's token.
type LogprobEntry = (f64, Vec<i32>, Vec<f64>);
type TopLogprobs<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<f64>>);

fn produced(py: Python<'_>, (token, piece, stop): (i32, Vec<u8>, bool)) -> PyResult<Py<PyAny>> {
    Ok((token, PyBytes::new(py, &piece), stop)
        .into_pyobject(py)?
        .into_any()
        .unbind())
}

/// A group of `branch_step`: `(items, all_rows, done)`.
type PyStepGroup = (Vec<(u64, PyStepInput)>, bool, Py<PyAny>);

/// An item of `branch_step`: a token to commit or tokens to prefill.
#[derive(FromPyObject)]
enum PyStepInput {
    Commit(i32),
    Prefill(Vec<i32>),
}

impl From<PyStepInput> for StepInput {
    fn from(input: PyStepInput) -> Self {
        match input {
            PyStepInput::Commit(t) => StepInput::Commit(t),
            PyStepInput::Prefill(t) => StepInput::Prefill(t),
        }
    }
}

pub(crate) fn id(bits: u64) -> BranchId {
    BranchId::from_bits(bits)
}

fn branch_bits(py: Python<'_>, id: BranchId) -> PyResult<Py<PyAny>> {
    Ok(id.to_bits().into_pyobject(py)?.into_any().unbind())
}

fn tree_outcome(py: Python<'_>, t: TreeOutcome) -> PyResult<Py<PyAny>> {
    let leaves: Vec<(usize, u64)> = t
        .leaves
        .into_iter()
        .map(|(j, b)| (j, b.to_bits()))
        .collect();
    let n = t.rows.len() / t.vocab.max(1);
    let rows = PyArray1::from_vec(py, t.rows).reshape([n, t.vocab])?;
    Ok((leaves, rows).into_pyobject(py)?.into_any().unbind())
}

fn state_bytes(py: Python<'_>, data: Vec<u8>) -> PyResult<Py<PyAny>> {
    Ok(pyo3::types::PyBytes::new(py, &data).into_any().unbind())
}

/// `None` when every item succeeded, else one entry per item: `None` or
/// the exception for that item.
/// A produced token: `(token, piece bytes, is_stop)`.
type Piece = (i32, Vec<u8>, bool);

fn produced_many(py: Python<'_>, results: Vec<lloyal_core::Result<Piece>>) -> PyResult<Py<PyAny>> {
    let list = PyList::empty(py);
    for r in results {
        match r {
            Ok(p) => list.append(produced(py, p)?)?,
            Err(e) => list.append(to_pyerr(e).into_value(py))?,
        }
    }
    Ok(list.into_any().unbind())
}

fn item_errors(py: Python<'_>, results: ItemResults) -> PyResult<Py<PyAny>> {
    if results.iter().all(Result::is_ok) {
        return Ok(py.None());
    }
    let list = PyList::empty(py);
    for r in results {
        match r {
            Ok(()) => list.append(py.None())?,
            Err(e) => list.append(to_pyerr(e).into_value(py))?,
        }
    }
    Ok(list.into_any().unbind())
}

#[pymethods]
impl PyContext {
    fn branch_create(&self, params: &Bound<'_, PyAny>) -> PyResult<u64> {
        let params = params_from_py(params)?;
        Ok(self.inner.branch_create(params).py_err()?.to_bits())
    }

    /// A fork of the branch's first `at` positions (all with `None`),
    /// made at once; its KV copy is queued ahead of what follows.
    #[pyo3(signature = (branch, at=None))]
    fn branch_fork(&self, branch: u64, at: Option<i32>) -> PyResult<u64> {
        Ok(self
            .inner
            .branch_fork_at(id(branch), at)
            .py_err()?
            .to_bits())
    }

    /// `True` if the prune ran at once (the worker was idle), else `False`:
    /// call `branch_prune` then.
    fn branch_prune_now(&self, branch: u64, cascade: bool) -> PyResult<bool> {
        self.inner
            .branch_prune_now(id(branch), cascade)
            .transpose()
            .map(|r| r.is_some())
            .py_err()
    }

    fn branch_prune(&self, branch: u64, cascade: bool, done: Py<PyAny>) {
        self.inner
            .branch_prune(id(branch), cascade, py_reply(done, none));
    }

    /// Free a branch nobody holds (``Branch.__del__``); fire and forget.
    fn branch_drop(&self, branch: u64) {
        self.inner.branch_drop(id(branch));
    }

    fn branch_retain_only(&self, branch: u64, done: Py<PyAny>) {
        self.inner
            .branch_retain_only(id(branch), py_reply(done, none));
    }

    fn branch_commit(&self, items: Vec<(u64, i32)>, done: Py<PyAny>) {
        let items = items.into_iter().map(|(b, t)| (id(b), t)).collect();
        self.inner.branch_commit(items, py_reply(done, item_errors));
    }

    fn branch_clear_and_reseed(
        &self,
        branch: u64,
        sinks: Vec<i32>,
        tail: Vec<i32>,
        done: Py<PyAny>,
    ) {
        self.inner
            .branch_clear_and_reseed(id(branch), sinks, tail, py_reply(done, none));
    }

    /// One step of several groups (``lloyal_core::Context::branch_step``):
    /// each group is ``(items, all_rows, done)``, an item ``(branch,
    /// token)`` to commit or ``(branch, [tokens])`` to prefill; each
    /// ``done`` gets its group's per-item errors.
    fn branch_step(&self, groups: Vec<PyStepGroup>) {
        let groups = groups
            .into_iter()
            .map(|(items, all_rows, done)| {
                let items = items
                    .into_iter()
                    .map(|(b, input)| (id(b), input.into()))
                    .collect();
                (items, all_rows, py_reply(done, item_errors))
            })
            .collect();
        self.inner.branch_step(groups);
    }

    #[pyo3(signature = (items, done, all_rows=false))]
    fn branch_prefill(&self, items: Vec<(u64, Vec<i32>)>, done: Py<PyAny>, all_rows: bool) {
        let items = items.into_iter().map(|(b, t)| (id(b), t)).collect();
        self.inner
            .branch_prefill(items, all_rows, py_reply(done, item_errors));
    }

    /// Decode a token tree into ``branch`` (see
    /// ``lloyal_core::Context::branch_prefill_tree``); ``done`` gets
    /// ``([(leaf node, branch)], rows)`` with rows an ``(n, vocab)`` array.
    fn branch_prefill_tree(
        &self,
        branch: u64,
        tokens: Vec<i32>,
        parents: Vec<i32>,
        done: Py<PyAny>,
    ) {
        self.inner
            .branch_prefill_tree(id(branch), tokens, parents, py_reply(done, tree_outcome));
    }

    /// Every position's logits of the branch's last ``all_rows`` prefill,
    /// as an ``(n, vocab)`` array (``None`` once taken).
    fn branch_take_rows<'py>(
        &self,
        py: Python<'py>,
        branch: u64,
    ) -> PyResult<Option<Bound<'py, PyArray2<f32>>>> {
        let Some(rows) = self.inner.branch_take_rows(id(branch)).py_err()? else {
            return Ok(None);
        };
        let vocab = self.inner.model().vocab_size() as usize;
        let n = rows.len() / vocab.max(1);
        Ok(Some(PyArray1::from_vec(py, rows).reshape([n, vocab])?))
    }

    /// Whether ``branch_produce`` is slow enough to run off the event loop.
    fn branch_produce_is_slow(&self, branch: u64) -> PyResult<bool> {
        self.inner.branch_produce_is_slow(id(branch)).py_err()
    }

    /// ``(token, piece bytes, is_stop)``: one call per branch per step.
    fn branch_produce<'py>(
        &self,
        py: Python<'py>,
        branch: u64,
    ) -> PyResult<(i32, Bound<'py, PyBytes>, bool)> {
        let inner = self.inner.clone();
        let (token, piece, stop) = py
            .detach(move || {
                let token = inner.branch_produce(id(branch))?;
                let model = inner.model();
                Ok::<_, lloyal_core::Error>((
                    token,
                    model.token_bytes(token, false)?,
                    model.is_stop_token(token)?,
                ))
            })
            .py_err()?;
        Ok((token, PyBytes::new(py, &piece), stop))
    }

    /// `branch_produce` on a sampler thread (slow samplers), completing
    /// ``done`` with ``(token, piece bytes, is_stop)``; the event loop
    /// settles it without waiting for the GIL to come back from a thread.
    fn branch_produce_async(&self, branch: u64, done: Py<PyAny>) {
        let model = Arc::clone(self.inner.model());
        let out: Reply<(i32, Vec<u8>, bool)> = py_reply(done, produced);
        self.inner.branch_produce_off_thread(
            id(branch),
            Reply::new(move |result: lloyal_core::Result<i32>| {
                out.send(result.and_then(|token| {
                    Ok((
                        token,
                        model.token_bytes(token, false)?,
                        model.is_stop_token(token)?,
                    ))
                }))
            }),
        );
    }

    /// ``branch_produce`` for many branches (``Context::branch_produce_many``):
    /// ``done`` gets a list with, per branch, ``(token, piece bytes,
    /// is_stop)`` or the exception it failed with. Slow samplers run
    /// in parallel off the caller's thread.
    fn branch_produce_many(&self, branches: Vec<u64>, done: Py<PyAny>) {
        let model = Arc::clone(self.inner.model());
        let out: Reply<Vec<lloyal_core::Result<Piece>>> = py_reply(done, produced_many);
        let ids = branches.into_iter().map(id).collect();
        self.inner.branch_produce_many(
            ids,
            Reply::new(
                move |result: lloyal_core::Result<Vec<lloyal_core::Result<i32>>>| {
                    let piece = |token: i32| -> lloyal_core::Result<Piece> {
                        Ok((
                            token,
                            model.token_bytes(token, false)?,
                            model.is_stop_token(token)?,
                        ))
                    };
                    out.send(
                        result
                            .map(|tokens| tokens.into_iter().map(|r| r.and_then(piece)).collect()),
                    )
                },
            ),
        );
    }

    fn branch_accept(&self, branch: u64, token: i32) -> PyResult<()> {
        self.inner.branch_accept(id(branch), token).py_err()
    }

    fn branch_set_params(&self, branch: u64, params: &Bound<'_, PyAny>) -> PyResult<bool> {
        let params = params_from_py(params)?;
        self.inner.branch_set_params(id(branch), params).py_err()
    }

    fn branch_params(&self, branch: u64) -> PyResult<PySamplingParams> {
        let inner = self
            .inner
            .read_branch(id(branch), |b| b.sampler().params().clone())
            .py_err()?;
        Ok(PySamplingParams { inner })
    }

    fn branch_reseed(&self, branch: u64, seed: u64) -> PyResult<()> {
        self.inner.branch_reseed(id(branch), seed).py_err()
    }

    fn branch_logits<'py>(
        &self,
        py: Python<'py>,
        branch: u64,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let logits = self
            .inner
            .with_branch(id(branch), |b| Ok(b.logits()?.clone()))
            .py_err()?;
        Ok(PyArray1::from_slice(py, &logits))
    }

    fn branch_set_logits(&self, branch: u64, logits: PyReadonlyArray1<'_, f32>) -> PyResult<()> {
        self.inner
            .branch_set_logits(id(branch), f32_slice(&logits)?)
            .py_err()
    }

    #[pyo3(signature = (branch, position, logits, done))]
    fn branch_truncate(
        &self,
        branch: u64,
        position: i32,
        logits: Option<PyReadonlyArray1<'_, f32>>,
        done: Py<PyAny>,
    ) -> PyResult<()> {
        let logits = match &logits {
            Some(l) => Some(f32_slice(l)?.to_vec()),
            None => None,
        };
        self.inner
            .branch_truncate(id(branch), position, logits, py_reply(done, none));
        Ok(())
    }

    fn branch_set_logit_bias(&self, branch: u64, biases: Vec<(i32, f32)>) -> PyResult<()> {
        self.inner
            .branch_set_logit_bias(id(branch), biases)
            .py_err()
    }

    fn branch_steer(&self, branch: u64, biases: Vec<(i32, f32)>) -> PyResult<()> {
        self.inner.branch_steer(id(branch), biases).py_err()
    }

    fn branch_entropy(&self, py: Python<'_>, branch: u64, base: &str) -> PyResult<f64> {
        let base: Base = base.parse().py_err()?;
        let view = self.inner.branch_logits_view(id(branch)).py_err()?;
        py.detach(move || view.entropy(base)).py_err()
    }

    /// ``(tokens, logprobs)``: the ``k`` most likely next tokens, best first.
    fn branch_top_logprobs<'py>(
        &self,
        py: Python<'py>,
        branch: u64,
        k: usize,
    ) -> PyResult<TopLogprobs<'py>> {
        let view = self.inner.branch_logits_view(id(branch)).py_err()?;
        let top = py.detach(move || view.top_logprobs(k)).py_err()?;
        let tokens: Vec<i32> = top.iter().map(|t| t.0).collect();
        let logprobs: Vec<f64> = top.iter().map(|t| t.1).collect();
        Ok((
            PyArray1::from_vec(py, tokens),
            PyArray1::from_vec(py, logprobs),
        ))
    }

    /// For each `(branch, token)`: the token's log-probability under the
    /// branch's logits and the branch's `k` most likely tokens with theirs,
    /// `(logprob, tokens, logprobs)`; all in one call, without the GIL.
    fn branch_logprobs_many(
        &self,
        py: Python<'_>,
        items: Vec<(u64, i32)>,
        k: usize,
    ) -> PyResult<Vec<LogprobEntry>> {
        let mut views = Vec::with_capacity(items.len());
        for &(branch, token) in &items {
            self.inner.model().check_token(token).py_err()?;
            views.push((self.inner.branch_logits_view(id(branch)).py_err()?, token));
        }
        py.detach(move || {
            views
                .into_iter()
                .map(|(view, token)| {
                    let logprob = view
                        .logprobs(&[token])?
                        .first()
                        .copied()
                        .unwrap_or(f64::NAN);
                    let (tokens, logprobs) = if k == 0 {
                        (Vec::new(), Vec::new())
                    } else {
                        view.top_logprobs(k)?.into_iter().unzip()
                    };
                    Ok((logprob, tokens, logprobs))
                })
                .collect::<lloyal_core::Result<Vec<_>>>()
        })
        .py_err()
    }

    fn branch_logprobs<'py>(
        &self,
        py: Python<'py>,
        branch: u64,
        tokens: Vec<i32>,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        self.inner.model().check_tokens(&tokens).py_err()?;
        let view = self.inner.branch_logits_view(id(branch)).py_err()?;
        let out = view.logprobs(&tokens).py_err()?;
        Ok(PyArray1::from_vec(py, out))
    }

    fn branch_surprisal(&self, branch: u64, token: i32, base: &str) -> PyResult<f64> {
        let base: Base = base.parse().py_err()?;
        self.inner.model().check_token(token).py_err()?;
        self.inner
            .with_branch(id(branch), |b| b.model_surprisal(token, base))
            .py_err()
    }

    /// Everything cheap to read about a branch, in one call.
    fn branch_info<'py>(&self, py: Python<'py>, branch: u64) -> PyResult<Bound<'py, PyDict>> {
        let (position, fork_head, ppl, sppl, count, parent, children, busy) = self
            .inner
            .read_branch(id(branch), |b| {
                (
                    b.position,
                    b.fork_head,
                    b.perplexity.perplexity(),
                    b.sampling_perplexity.perplexity(),
                    b.perplexity.count(),
                    b.parent.map(BranchId::to_bits),
                    b.children.iter().map(|c| c.to_bits()).collect::<Vec<_>>(),
                    b.is_busy(),
                )
            })
            .py_err()?;
        let d = PyDict::new(py);
        d.set_item("position", position)?;
        d.set_item("fork_head", fork_head)?;
        d.set_item("perplexity", ppl)?;
        d.set_item("sampling_perplexity", sppl)?;
        d.set_item("accepted", count)?;
        d.set_item("parent", parent)?;
        d.set_item("children", children)?;
        d.set_item("busy", busy)?;
        Ok(d)
    }

    fn branch_alive(&self, branch: u64) -> bool {
        self.inner.read_branch(id(branch), |_| ()).is_ok()
    }

    fn branch_save(&self, branch: u64, done: Py<PyAny>) {
        self.inner
            .branch_save(id(branch), py_reply(done, state_bytes));
    }

    fn branch_restore(
        &self,
        data: &[u8],
        params: &Bound<'_, PyAny>,
        done: Py<PyAny>,
    ) -> PyResult<()> {
        let params = params_from_py(params)?;
        self.inner
            .branch_restore(data.to_vec(), params, py_reply(done, branch_bits));
        Ok(())
    }

    fn leases_available(&self) -> usize {
        self.inner.leases_available()
    }

    fn branch_cells_held(&self) -> u64 {
        self.inner.branch_cells_held()
    }

    fn branch_sampler_state<'py>(
        &self,
        py: Python<'py>,
        branch: u64,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let state = self.inner.branch_sampler_state(id(branch)).py_err()?;
        Ok(pyo3::types::PyBytes::new(py, &state))
    }

    fn branch_set_sampler_state(&self, branch: u64, state: &[u8]) -> PyResult<()> {
        self.inner
            .branch_set_sampler_state(id(branch), state)
            .py_err()
    }

    fn branch_detach(&self, branch: u64) -> PyResult<()> {
        self.inner.branch_detach(id(branch)).py_err()
    }

    fn branch_clear_logits(&self, branch: u64) -> PyResult<()> {
        self.inner.branch_clear_logits(id(branch)).py_err()
    }
}
