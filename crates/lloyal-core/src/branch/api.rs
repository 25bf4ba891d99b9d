//! The branch operations a caller starts: cheap ones run under the
//! `branches` lock on the caller's thread; anything touching the KV cache
//! becomes a [`BranchJob`] for the worker, or a step (commits, prefills).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use super::job::{mark_busy, BranchJob};
use super::ops::make_fork;
use super::tree::{check_tree, TreeOutcome};
use crate::adapter::Adapters;
use crate::engine::{panic_text, unanswered};
use crate::engine::{Context, Job, Reply, Shared, Task};
use crate::error::{invalid, Error, Result};
use crate::grammar::Grammar;
use crate::sampling::SamplingParams;
use crate::state::LogitsView;
use crate::state::{BranchId, BranchState};
use crate::sync::lock;

impl Context {
    /// Create a root branch with its own KV lease (synchronous: no decode).
    pub fn branch_create(&self, params: SamplingParams) -> Result<BranchId> {
        self.check_open()?;
        let mut branches = lock(&self.shared.branches);
        let seq = branches.lease(|s| self.shared.holds_flat_data(s))?;
        let state = match BranchState::new(seq, params) {
            Ok(mut s) => {
                self.model().bind_sampler(s.sampler_mut());
                s.adapters = lock(&self.shared.default_adapters).clone();
                s
            }
            Err(e) => {
                branches.release(seq);
                return Err(e);
            }
        };
        let id = branches.insert(state);
        drop(branches);
        if self.kv_seq_pos_max(seq).unwrap_or(-1) >= 0 {
            // Queued before any job that could use the branch.
            self.submit(Job::task(BranchJob::ClearSeq { seq }));
        }
        Ok(id)
    }

    /// The body of [`Branch::with`](crate::Branch::with).
    pub(crate) fn with_branch<T>(
        &self,
        id: BranchId,
        f: impl FnOnce(&mut BranchState) -> Result<T>,
    ) -> Result<T> {
        self.check_open()?;
        let mut branches = lock(&self.shared.branches);
        let state = branches.get_mut(id)?;
        if state.is_busy() {
            return Err(Error::BranchBusy);
        }
        f(state)
    }

    /// The body of [`Branch::set_adapters`](crate::Branch::set_adapters).
    pub(crate) fn branch_set_adapters(&self, id: BranchId, adapters: Adapters) -> Result<()> {
        self.check_open()?;
        let adapters = adapters.checked(self.model())?;
        let mut branches = lock(&self.shared.branches);
        let branch = branches.get_mut(id)?;
        if branch.busy || branch.forks > 0 {
            return Err(Error::BranchBusy);
        }
        branch.adapters = adapters;
        Ok(())
    }

    /// Read a branch's state by id, even while an operation is in flight:
    /// for the ids of a batch ([`Branch::read`](crate::Branch::read) for one
    /// branch).
    pub fn read_branch<T>(&self, id: BranchId, f: impl FnOnce(&BranchState) -> T) -> Result<T> {
        self.check_open()?;
        let branches = lock(&self.shared.branches);
        Ok(f(branches.get(id)?))
    }

    /// The body of [`Branch::logits_view`](crate::Branch::logits_view).
    pub(crate) fn branch_logits_view(&self, id: BranchId) -> Result<LogitsView> {
        self.read_branch(id, BranchState::logits_view)?
    }

    /// Leases free now.
    pub fn leases_available(&self) -> usize {
        let branches = lock(&self.shared.branches);
        branches
            .free_seqs()
            .filter(|&s| !self.shared.holds_flat_data(s))
            .count()
    }

    /// The body of [`Branch::set_params`](crate::Branch::set_params).
    pub(crate) fn branch_set_params(&self, id: BranchId, params: SamplingParams) -> Result<bool> {
        self.with_branch(id, |b| {
            if *b.sampler().params() == params {
                return Ok(false);
            }
            b.sampler_mut().set_params(params)?;
            self.model().bind_sampler(b.sampler_mut());
            Ok(true)
        })
    }

    /// The body of [`Branch::reseed`](crate::Branch::reseed).
    pub(crate) fn branch_reseed(&self, id: BranchId, seed: u64) -> Result<()> {
        self.with_branch(id, |b| {
            b.sampler_mut().reseed(seed);
            Ok(())
        })
    }

    /// The body of [`Branch::set_logits`](crate::Branch::set_logits).
    pub(crate) fn branch_set_logits(&self, id: BranchId, logits: &[f32]) -> Result<()> {
        self.check_logits_len(logits)?;
        if let Some(i) = logits
            .iter()
            .position(|x| x.is_nan() || *x == f32::INFINITY)
        {
            return Err(invalid(format!(
                "logits must be numbers below +inf (-inf masks a token); entry {i} is {}",
                logits[i]
            )));
        }
        self.with_branch(id, |b| {
            b.set_logits(Arc::from(logits));
            Ok(())
        })
    }

    pub(super) fn check_biases(&self, biases: &[(i32, f32)]) -> Result<()> {
        for &(t, b) in biases {
            self.model().check_token(t)?;
            if b.is_nan() {
                return Err(invalid(format!("bias for token {t} is NaN")));
            }
        }
        Ok(())
    }

    /// The body of [`Branch::set_logit_bias`](crate::Branch::set_logit_bias).
    pub(crate) fn branch_set_logit_bias(
        &self,
        id: BranchId,
        biases: Vec<(i32, f32)>,
    ) -> Result<()> {
        self.check_biases(&biases)?;
        self.with_branch(id, |b| {
            b.logit_bias = Arc::new(biases);
            Ok(())
        })
    }

    /// The body of [`Branch::steer`](crate::Branch::steer).
    pub(crate) fn branch_steer(&self, id: BranchId, biases: Vec<(i32, f32)>) -> Result<()> {
        self.check_biases(&biases)?;
        self.with_branch(id, |b| {
            b.steer = biases;
            Ok(())
        })
    }

    /// The body of [`Branch::produce_is_slow`](crate::Branch::produce_is_slow).
    pub(crate) fn branch_produce_is_slow(&self, id: BranchId) -> Result<bool> {
        self.read_branch(id, BranchState::produce_is_slow)
    }

    /// The body of [`Branch::produce`](crate::Branch::produce).
    pub(crate) fn branch_produce(&self, id: BranchId) -> Result<i32> {
        self.with_branch(id, BranchState::produce)
    }

    /// The body of [`Branch::produce_off_thread`](crate::Branch::produce_off_thread).
    pub(crate) fn branch_produce_off_thread(&self, id: BranchId, reply: Reply<i32>) {
        let detached = (|| {
            self.check_open()?;
            let mut branches = lock(&self.shared.branches);
            let state = branches.get_mut(id)?;
            if state.is_busy() {
                return Err(Error::BranchBusy);
            }
            state.busy = true;
            Ok(state.detach_for_produce())
        })();
        let detached = match detached {
            Ok(d) => d,
            Err(e) => return reply.send(Err(e)),
        };
        // Reachable here until the thread has taken it, so that a thread
        // that cannot start still gives the branch back and answers.
        let slot = Arc::new(Mutex::new(Some((detached, reply))));
        let taken = Arc::clone(&slot);
        let shared = Arc::clone(&self.shared);
        fn finish(
            shared: &Shared,
            id: BranchId,
            detached: BranchState,
            result: Result<i32>,
        ) -> Result<i32> {
            if let Ok(state) = lock(&shared.branches).get_mut(id) {
                state.reattach(detached);
                state.busy = false;
            }
            result
        }
        let spawned = std::thread::Builder::new()
            .name("lloyal-sampler".into())
            .spawn(move || {
                let Some((mut detached, reply)) = lock(&taken).take() else {
                    return;
                };
                let result = catch_unwind(AssertUnwindSafe(|| detached.produce()))
                    .unwrap_or_else(|p| Err(Error::from_panic(p)));
                reply.send(finish(&shared, id, detached, result));
            });
        if let Err(e) = spawned {
            if let Some((detached, reply)) = lock(&slot).take() {
                let failed = Err(Error::Internal(format!(
                    "could not start a sampler thread: {e}"
                )));
                reply.send(finish(&self.shared, id, detached, failed));
            }
        }
    }

    /// The body of [`Branch::set_grammar`](crate::Branch::set_grammar).
    pub(crate) fn branch_set_grammar(&self, id: BranchId, grammar: Option<Grammar>) -> Result<()> {
        self.with_branch(id, |b| {
            b.set_grammar(grammar);
            Ok(())
        })
    }

    /// The body of [`Branch::clear_logits`](crate::Branch::clear_logits).
    pub(crate) fn branch_clear_logits(&self, id: BranchId) -> Result<()> {
        self.with_branch(id, |b| {
            b.clear_logits();
            Ok(())
        })
    }

    /// The body of [`Branch::sampler_state`](crate::Branch::sampler_state).
    pub(crate) fn branch_sampler_state(&self, id: BranchId) -> Result<Vec<u8>> {
        self.read_branch(id, |b| b.sampler.state())
    }

    /// The body of [`Branch::set_sampler_state`](crate::Branch::set_sampler_state).
    pub(crate) fn branch_set_sampler_state(&self, id: BranchId, state: &[u8]) -> Result<()> {
        self.with_branch(id, |b| b.sampler_mut().set_state(state))
    }

    /// The body of [`Branch::detach`](crate::Branch::detach).
    pub(crate) fn branch_detach(&self, id: BranchId) -> Result<()> {
        self.check_open()?;
        let mut branches = lock(&self.shared.branches);
        let state = branches.get_mut(id)?;
        if state.is_busy() {
            return Err(Error::BranchBusy);
        }
        if let Some(parent) = state.parent.take() {
            if let Ok(p) = branches.get_mut(parent) {
                p.children.retain(|&c| c != id);
            }
        }
        Ok(())
    }

    /// KV cells the branches hold, a shared prefix counted once
    /// (see `Branches::cells_held`); out of [`Context::n_ctx`].
    pub fn branch_cells_held(&self) -> u64 {
        lock(&self.shared.branches).cells_held()
    }

    /// The body of [`Branch::accept`](crate::Branch::accept).
    pub(crate) fn branch_accept(&self, id: BranchId, token: i32) -> Result<()> {
        self.model().check_token(token)?;
        self.with_branch(id, |b| b.accept(token))
    }

    pub(super) fn submit_for(&self, ids: &[BranchId], job: BranchJob) {
        let marked = self
            .check_open()
            .and_then(|()| mark_busy(&mut lock(&self.shared.branches), ids));
        match marked {
            Ok(()) => self.submit(Job::task(job)),
            Err(e) => job.fail(e),
        }
    }

    /// Fork: a new branch sharing `parent`'s KV prefix (no tensor copy under
    /// unified KV) with a clone of its sampler, logits, metrics and bias.
    /// See [`Branch::fork`](crate::Branch::fork).
    pub(crate) fn branch_fork(&self, parent: BranchId) -> Result<BranchId> {
        self.branch_fork_at(parent, None)
    }

    /// The body of [`Branch::fork`](crate::Branch::fork).
    pub(crate) fn branch_fork_at(&self, parent: BranchId, at: Option<i32>) -> Result<BranchId> {
        self.check_open()?;
        let made = {
            let mut branches = lock(&self.shared.branches);
            if branches.get(parent)?.busy {
                return Err(Error::BranchBusy);
            }
            let made = make_fork(&mut branches, &self.shared, parent, at)?;
            branches.get_mut(parent)?.forks += 1;
            made
        };
        let child = made.child;
        let copy = BranchJob::CopyFork {
            parent,
            child,
            src: made.src,
            dst: made.dst,
            end: made.end,
        };
        // An idle worker: copy here, now (a panic disposes of the child,
        // as on the worker, and fails the fork).
        let recover = Task::recover(&copy);
        let mut queued = Some(copy);
        let inline = self.run_inline(|w| {
            let Some(job) = queued.take() else {
                return Ok(());
            };
            catch_unwind(AssertUnwindSafe(|| {
                #[cfg(feature = "testing")]
                w.maybe_panic();
                w.execute_branch(job)
            }))
            .map_err(|payload| {
                if let Some(recover) = recover {
                    let _ = catch_unwind(AssertUnwindSafe(|| recover(w)));
                }
                unanswered(true, Some(&panic_text(payload)))
            })
        });
        match (inline, queued) {
            (Some(result), _) => result?,
            (None, Some(job)) => self.submit(Job::task(job)),
            (None, None) => {}
        }
        Ok(child)
    }

    /// The body of [`Branch::clear_and_reseed`](crate::Branch::clear_and_reseed).
    pub(crate) fn branch_clear_and_reseed(
        &self,
        id: BranchId,
        sinks: Vec<i32>,
        tail: Vec<i32>,
        reply: Reply<()>,
    ) {
        let mut tokens = sinks;
        tokens.extend(tail);
        if tokens.is_empty() {
            return reply.send(Err(invalid("sinks and tail are both empty")));
        }
        if let Err(e) = self.model().check_tokens(&tokens) {
            return reply.send(Err(e));
        }
        if tokens.len() > self.n_ctx() as usize {
            return reply.send(Err(invalid(format!(
                "sinks + tail hold {} tokens; the context holds n_ctx={}",
                tokens.len(),
                self.n_ctx()
            ))));
        }
        self.submit_for(&[id], BranchJob::Reseed { id, tokens, reply });
    }

    /// The body of [`Branch::truncate`](crate::Branch::truncate).
    pub(crate) fn branch_truncate(
        &self,
        id: BranchId,
        position: i32,
        logits: Option<Vec<f32>>,
        reply: Reply<()>,
    ) {
        let checked = self.read_branch(id, |b| b.position).and_then(|current| {
            if !(0..=current).contains(&position) {
                return Err(invalid(format!(
                    "position must be in [0, {current}] (the branch's position), got {position}"
                )));
            }
            match &logits {
                Some(l) => self.check_logits_len(l),
                None => Ok(()),
            }
        });
        match checked {
            Ok(()) => self.submit_for(
                &[id],
                BranchJob::Truncate {
                    id,
                    position,
                    logits,
                    reply,
                },
            ),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// The body of [`Branch::prune`](crate::Branch::prune).
    pub(crate) fn branch_prune(&self, id: BranchId, cascade: bool, reply: Reply<()>) {
        let checked = self
            .check_open()
            .and_then(|()| lock(&self.shared.branches).get(id).map(|_| ()));
        match checked {
            Ok(()) => self.submit(Job::task(BranchJob::Prune { id, cascade, reply })),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// Free a branch its owner dropped without pruning (a Python `Branch`
    /// garbage-collected): its lease and the cells only it used come back,
    /// and its children become roots (they keep their cells). Queued behind
    /// whatever is in flight; nothing to wait for, and a branch already
    /// gone is no error.
    pub(crate) fn branch_drop(&self, id: BranchId) {
        if self.check_open().is_err() {
            return;
        }
        let freed = {
            let mut branches = lock(&self.shared.branches);
            match branches.get(id) {
                Err(_) => return,
                // An operation is in flight: free it after that.
                Ok(b) if b.is_busy() => None,
                Ok(_) => {
                    branches.detach_children(id);
                    let state = branches.remove(id).ok();
                    state.map(|s| {
                        branches.release(s.seq);
                        s.seq
                    })
                }
            }
        };
        match freed {
            // The lease is free now, so a branch created next can take it:
            // its cells are cleared by a job queued ahead of anything that
            // new branch does (the mirror says so already).
            Some(seq) => {
                self.shared.forget_seq(seq);
                self.submit(Job::task(BranchJob::ClearSeq { seq }));
            }
            None => self.submit(Job::task(BranchJob::Drop { id })),
        }
    }

    /// The body of [`Branch::prune_now`](crate::Branch::prune_now).
    pub(crate) fn branch_prune_now(&self, id: BranchId, cascade: bool) -> Option<Result<()>> {
        self.run_inline(|w| w.prune(id, cascade))
    }

    /// The body of [`Branch::prefill_tree`](crate::Branch::prefill_tree).
    pub(crate) fn branch_prefill_tree(
        &self,
        root: BranchId,
        tokens: Vec<i32>,
        parents: Vec<i32>,
        reply: Reply<TreeOutcome>,
    ) {
        let checked =
            check_tree(&tokens, &parents).and_then(|()| self.model().check_tokens(&tokens));
        match checked {
            Ok(()) => self.submit_for(
                &[root],
                BranchJob::PrefillTree {
                    root,
                    tokens,
                    parents,
                    reply,
                },
            ),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// The body of [`Branch::take_rows`](crate::Branch::take_rows).
    pub(crate) fn branch_take_rows(&self, id: BranchId) -> Result<Option<Vec<f32>>> {
        self.check_open()?;
        Ok(lock(&self.shared.branches).get_mut(id)?.rows.take())
    }

    /// The body of [`Branch::retain_only`](crate::Branch::retain_only).
    pub(crate) fn branch_retain_only(&self, keep: BranchId, reply: Reply<()>) {
        self.submit_for(&[keep], BranchJob::RetainOnly { keep, reply });
    }

    /// The body of [`Branch::save`](crate::Branch::save).
    pub(crate) fn branch_save(&self, id: BranchId, reply: Reply<Vec<u8>>) {
        self.submit_for(&[id], BranchJob::Save { id, reply });
    }

    /// A new root branch (own lease) from a [`Branch::save`](crate::Branch::save) snapshot.
    pub fn branch_restore(&self, data: Vec<u8>, params: SamplingParams, reply: Reply<BranchId>) {
        match self.check_open().and_then(|()| params.validate()) {
            Ok(()) => self.submit(Job::task(BranchJob::Restore {
                data,
                params,
                reply,
            })),
            Err(e) => reply.send(Err(e)),
        }
    }
}
