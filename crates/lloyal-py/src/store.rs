//! What `lloyal.BranchStore` and branch creation call on `NativeContext`:
//! operations on many branches at once (a step's groups, produce and
//! logprobs for many, a token tree) and the ones that make branches.
//! Branches come in as `NativeBranch` objects and out as seeds.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use lloyal_core::{Branch, BranchId, ItemResults, Reply, StepInput, TreeOutcome};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::branch::{piece, produced, seed, PyBranch, Seedling};
use crate::context::PyContext;
use crate::errors::{to_pyerr, IntoPyResult};
use crate::reply::{none, py_reply};
use crate::sampling::params_from_py;

/// `(logprob, top tokens, their logprobs)` of one branch's token.
type LogprobEntry = (f64, Vec<i32>, Vec<f64>);

/// A group of `branch_step`: `(items, all_rows, done, cancel)`.
type PyStepGroup<'py> = (
    Vec<(Bound<'py, PyBranch>, PyStepInput)>,
    bool,
    Py<PyAny>,
    Bound<'py, CancelFlag>,
);

/// What a caller sets when it gives up on an operation (its wait was
/// cancelled): the worker stops the operation at its next round and undoes
/// it (``lloyal_core::Reply::cancel_with``).
#[pyclass(module = "lloyal._lloyal", frozen)]
#[derive(Default)]
pub struct CancelFlag(Arc<AtomicBool>);

#[pymethods]
impl CancelFlag {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    fn set(&self) {
        self.0.store(true, Ordering::Release);
    }

    fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

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

/// A token tree's leaves as `(node, seed)`, `None` for the root's own leaf,
/// and every node's logits as one `(n, vocab)` array.
struct TreeSeeds {
    leaves: Vec<(usize, Option<Seedling>)>,
    rows: Vec<f32>,
    vocab: usize,
}

fn tree_seeds(py: Python<'_>, t: TreeSeeds) -> PyResult<Py<PyAny>> {
    let leaves = PyList::empty(py);
    for (j, s) in t.leaves {
        let s = s.map(|s| seed(py, s)).transpose()?;
        leaves.append((j, s))?;
    }
    let n = t.rows.len() / t.vocab.max(1);
    let rows = PyArray1::from_vec(py, t.rows).reshape([n, t.vocab])?;
    Ok((leaves, rows).into_pyobject(py)?.into_any().unbind())
}

/// `None` when every item succeeded, else one entry per item: `None` or
/// the exception for that item.
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

/// A produced token per branch: `(token, piece bytes, is_stop)` or the
/// exception it failed with.
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

impl PyContext {
    fn seedling(&self, branch: Branch) -> Seedling {
        Seedling(branch, Arc::clone(&self.objects))
    }

    /// `branch`'s handle, if it is this context's: the one-branch verbs a
    /// store calls run on the branch's own context, so one of another
    /// context's is refused here, as an id of it is by the engine.
    fn own<'b>(&self, branch: &'b PyBranch) -> PyResult<&'b Branch> {
        if Arc::ptr_eq(branch.inner.context(), &self.inner) {
            Ok(&branch.inner)
        } else {
            Err(to_pyerr(lloyal_core::Error::InvalidArgument(
                "the branch belongs to another context".to_owned(),
            )))
        }
    }
}

#[pymethods]
impl PyContext {
    /// A new root branch, as a seed for ``lloyal.Branch``.
    fn branch_create(&self, py: Python<'_>, params: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let branch = Branch::create(&self.inner, params_from_py(params)?).py_err()?;
        seed(py, self.seedling(branch))
    }

    /// A new root branch from ``Branch.save`` bytes; ``done`` gets its seed.
    fn branch_restore(
        &self,
        data: &[u8],
        params: &Bound<'_, PyAny>,
        done: Py<PyAny>,
    ) -> PyResult<()> {
        let params = params_from_py(params)?;
        let out = py_reply(done, seed);
        let ctx = Arc::clone(&self.inner);
        let objects = Arc::clone(&self.objects);
        self.inner.branch_restore(
            data.to_vec(),
            params,
            Reply::new(move |r: lloyal_core::Result<BranchId>| {
                out.send(r.map(|id| Seedling(Branch::adopt(&ctx, id), objects)))
            }),
        );
        Ok(())
    }

    /// One step of several groups (``lloyal_core::Context::branch_step``):
    /// each group is ``(items, all_rows, done, cancel)``, an item
    /// ``(branch, token)`` to commit or ``(branch, [tokens])`` to prefill;
    /// each ``done`` gets its group's per-item errors. A group whose
    /// ``cancel`` is set before it finishes is undone.
    fn branch_step(&self, groups: Vec<PyStepGroup<'_>>) {
        let groups = groups
            .into_iter()
            .map(|(items, all_rows, done, cancel)| {
                let items = items
                    .into_iter()
                    .map(|(b, input)| (b.get().id(), input.into()))
                    .collect();
                let flag = Arc::clone(&cancel.get().0);
                (
                    items,
                    all_rows,
                    py_reply(done, item_errors).cancel_with(flag),
                )
            })
            .collect();
        self.inner.branch_step(groups);
    }

    /// ``Branch._produce_now`` for many branches
    /// (``Context::branch_produce_many``): ``done`` gets a list with, per
    /// branch, ``(token, piece bytes, is_stop)`` or the exception it failed
    /// with. Slow samplers run in parallel off the caller's thread.
    fn branch_produce_many(&self, branches: Vec<Bound<'_, PyBranch>>, done: Py<PyAny>) {
        let model = Arc::clone(self.inner.model());
        let out: Reply<Vec<lloyal_core::Result<Piece>>> = py_reply(done, produced_many);
        let ids = branches.iter().map(|b| b.get().id()).collect();
        self.inner.branch_produce_many(
            ids,
            Reply::new(
                move |result: lloyal_core::Result<Vec<lloyal_core::Result<i32>>>| {
                    out.send(result.map(|tokens| {
                        tokens
                            .into_iter()
                            .map(|r| r.and_then(|t| piece(&model, t)))
                            .collect()
                    }))
                },
            ),
        );
    }

    /// For each `(branch, token)`: the token's log-probability under the
    /// branch's logits and the branch's `k` most likely tokens with theirs,
    /// `(logprob, tokens, logprobs)`; all in one call, without the GIL.
    fn branch_logprobs_many(
        &self,
        py: Python<'_>,
        items: Vec<(Bound<'_, PyBranch>, i32)>,
        k: usize,
    ) -> PyResult<Vec<LogprobEntry>> {
        let mut views = Vec::with_capacity(items.len());
        for (branch, token) in &items {
            self.inner.model().check_token(*token).py_err()?;
            views.push((self.own(branch.get())?.logits_view().py_err()?, *token));
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

    /// Decode a token tree into ``root`` (see
    /// ``lloyal_core::Branch::prefill_tree``); ``done`` gets
    /// ``([(leaf node, seed or None for root's own)], rows)`` with rows an
    /// ``(n, vocab)`` array.
    fn branch_prefill_tree(
        &self,
        root: &PyBranch,
        tokens: Vec<i32>,
        parents: Vec<i32>,
        done: Py<PyAny>,
    ) -> PyResult<()> {
        let root = self.own(root)?;
        let out = py_reply(done, tree_seeds);
        let ctx = Arc::clone(&self.inner);
        let objects = Arc::clone(&self.objects);
        let root_id = root.id();
        let reply = Reply::new(move |r: lloyal_core::Result<TreeOutcome>| {
            out.send(r.map(|t| {
                TreeSeeds {
                    leaves: t
                        .leaves
                        .into_iter()
                        .map(|(j, id)| {
                            let leaf = (id != root_id)
                                .then(|| Seedling(Branch::adopt(&ctx, id), Arc::clone(&objects)));
                            (j, leaf)
                        })
                        .collect(),
                    rows: t.rows,
                    vocab: t.vocab,
                }
            }))
        });
        root.prefill_tree(tokens, parents, reply);
        Ok(())
    }

    /// Keep ``winner``'s KV and prune every other branch.
    fn branch_retain_only(&self, winner: &PyBranch, done: Py<PyAny>) -> PyResult<()> {
        self.own(winner)?.retain_only(py_reply(done, none));
        Ok(())
    }

    fn leases_available(&self) -> usize {
        self.inner.leases_available()
    }

    fn branch_cells_held(&self) -> u64 {
        self.inner.branch_cells_held()
    }
}
