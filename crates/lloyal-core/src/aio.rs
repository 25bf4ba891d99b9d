//! The engine's requests as `async fn`s: [`Context::aio`].
//!
//! Each request goes to the context's worker thread with a
//! `tokio::sync::oneshot` sender as its [`Reply`]; the returned future
//! awaits the receiver. No runtime is needed for that (tokio's oneshot is
//! executor-agnostic), and the worker stays one OS thread that owns the
//! llama.cpp context.
//!
//! This is the async surface for Rust callers. The methods on [`Context`]
//! that take a [`Reply`] are the primitive under it, kept public for the
//! bindings: they complete a Python awaitable from the worker thread,
//! where no Rust runtime runs to poll a future, so a callback is what they
//! need. Each `aio` method is that call with a oneshot reply.
//!
//! A request is submitted when its future is first polled. Dropping the
//! future after that (a cancelled task) does not cancel the work: the
//! worker runs it to completion, so a branch is wholly before or wholly
//! after the operation, never in between; the answer is discarded.

use tokio::sync::oneshot;

use crate::branch::TreeOutcome;
use crate::engine::{Context, ItemResults, Reply, StepInput};
use crate::error::{Error, Result};
use crate::BranchId;
use crate::SamplingParams;

/// A reply and the future that resolves to what it is sent.
fn channel<T: Send + 'static>() -> (Reply<T>, impl std::future::Future<Output = Result<T>>) {
    let (tx, rx) = oneshot::channel();
    let reply = Reply::new(move |r| {
        let _ = tx.send(r);
    });
    let answer = async move {
        rx.await
            .unwrap_or_else(|_| Err(Error::Internal("the engine dropped the reply".to_owned())))
    };
    (reply, answer)
}

/// Turn a batched call's answer into one `Result`: the first failed
/// item's error, if any.
fn all_ok(results: ItemResults) -> Result<()> {
    results.into_iter().collect()
}

/// `async fn` versions of a [`Context`]'s requests (see the module docs).
#[derive(Clone, Copy)]
pub struct Aio<'a>(&'a Context);

impl Context {
    /// This context's requests as `async fn`s.
    pub fn aio(&self) -> Aio<'_> {
        Aio(self)
    }
}

impl Aio<'_> {
    /// [`Context::decode`]: tokens at positions `pos..` of sequence `seq`.
    pub async fn decode(self, tokens: Vec<i32>, pos: i32, seq: i32) -> Result<()> {
        let (reply, answer) = channel();
        self.0.decode(tokens, pos, seq, reply);
        answer.await
    }

    /// [`Branch::fork`](crate::Branch::fork): made at once (its KV copy is queued
    /// ahead of anything done with it next), so this never waits.
    pub async fn fork(self, parent: BranchId) -> Result<BranchId> {
        self.0.branch_fork(parent)
    }

    /// [`Branch::fork`](crate::Branch::fork): a fork of `parent`'s first `at` positions.
    pub async fn fork_at(self, parent: BranchId, at: Option<i32>) -> Result<BranchId> {
        self.0.branch_fork_at(parent, at)
    }

    /// [`Branch::produce`](crate::Branch::produce): the next token (the random stream
    /// advances; nothing is written). A slow sampler
    /// ([`Branch::produce_is_slow`](crate::Branch::produce_is_slow)) runs on a thread of its own,
    /// so the task's runtime thread is not held for it.
    pub async fn produce(self, id: BranchId) -> Result<i32> {
        if !self.0.branch_produce_is_slow(id)? {
            return self.0.branch_produce(id);
        }
        let (reply, answer) = channel();
        self.0.branch_produce_off_thread(id, reply);
        answer.await
    }

    /// [`Context::branch_commit`]: one token per branch, one decode (merged
    /// with commits other callers queued meanwhile). Fails with the first
    /// item's error; use [`Aio::commit_each`] for one result per item.
    pub async fn commit(self, items: Vec<(BranchId, i32)>) -> Result<()> {
        all_ok(self.commit_each(items).await?)
    }

    /// [`Context::branch_commit`], one result per item.
    pub async fn commit_each(self, items: Vec<(BranchId, i32)>) -> Result<ItemResults> {
        let (reply, answer) = channel();
        self.0.branch_commit(items, reply);
        answer.await
    }

    /// [`Context::branch_step`] with one group: commits and prefills of
    /// several branches, all or nothing on a full KV cache; one result per
    /// item (an item that fails alone, a pruned branch say, fails alone).
    pub async fn step(self, items: Vec<(BranchId, StepInput)>) -> Result<ItemResults> {
        let (reply, answer) = channel();
        self.0.branch_step(vec![(items, false, reply)]);
        answer.await
    }

    /// [`Context::branch_prefill`]: token lists for several branches.
    pub async fn prefill(self, items: Vec<(BranchId, Vec<i32>)>, all_rows: bool) -> Result<()> {
        let (reply, answer) = channel();
        self.0.branch_prefill(items, all_rows, reply);
        all_ok(answer.await?)
    }

    /// [`Branch::prefill_tree`](crate::Branch::prefill_tree).
    pub async fn prefill_tree(
        self,
        root: BranchId,
        tokens: Vec<i32>,
        parents: Vec<i32>,
    ) -> Result<TreeOutcome> {
        let (reply, answer) = channel();
        self.0.branch_prefill_tree(root, tokens, parents, reply);
        answer.await
    }

    /// [`Branch::truncate`](crate::Branch::truncate).
    pub async fn truncate(
        self,
        id: BranchId,
        position: i32,
        logits: Option<Vec<f32>>,
    ) -> Result<()> {
        let (reply, answer) = channel();
        self.0.branch_truncate(id, position, logits, reply);
        answer.await
    }

    /// [`Branch::prune`](crate::Branch::prune) (`cascade`: the whole subtree).
    pub async fn prune(self, id: BranchId, cascade: bool) -> Result<()> {
        let (reply, answer) = channel();
        self.0.branch_prune(id, cascade, reply);
        answer.await
    }

    /// [`Branch::save`](crate::Branch::save).
    pub async fn save(self, id: BranchId) -> Result<Vec<u8>> {
        let (reply, answer) = channel();
        self.0.branch_save(id, reply);
        answer.await
    }

    /// [`Context::branch_restore`].
    pub async fn restore(self, data: Vec<u8>, params: SamplingParams) -> Result<BranchId> {
        let (reply, answer) = channel();
        self.0.branch_restore(data, params, reply);
        answer.await
    }

    /// [`Context::embed`]: one pooled vector per input.
    pub async fn embed(self, inputs: Vec<Vec<i32>>) -> Result<Vec<Vec<f32>>> {
        let (reply, answer) = channel();
        self.0.embed(inputs, reply);
        answer.await
    }

    /// [`Context::close`]: queued requests fail with
    /// [`Error::ContextClosed`].
    pub async fn close(self) -> Result<()> {
        let (reply, answer) = channel();
        self.0.close(reply);
        answer.await
    }
}
