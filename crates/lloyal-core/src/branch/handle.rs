//! [`Branch`]: an owned branch, the handle a caller keeps.
//!
//! The `Context::branch_*` methods name a branch by its [`BranchId`], a
//! plain value that many batched calls take at once (a step's commits, a
//! store's produce). A `Branch` owns one: its methods are the one-branch
//! verbs, and dropping it without [`Branch::prune`] gives the lease and the
//! cells only it used back ([`Context::branch_drop`]), like a file closed
//! on drop. Ids stay for batches and for what must travel as bytes
//! (snapshots, a cluster's messages): [`Branch::id`] lends one,
//! [`Branch::into_id`] gives ownership up.

use std::sync::Arc;

use crate::engine::{Context, Reply};
use crate::error::Result;
use crate::grammar::Grammar;
use crate::sampling::SamplingParams;
use crate::state::{BranchId, BranchState, LogitsView};

/// An owned branch of a [`Context`]: dropped unpruned, its lease is given
/// back (queued behind whatever is in flight on it).
///
/// ```
/// use std::sync::Arc;
/// use lloyal_core::{Branch, Context, ContextParams, SamplingParams};
///
/// let path = std::env::var("LLOYAL_TEST_MODEL").unwrap_or_else(|_| "model.gguf".into());
/// # if !std::path::Path::new(&path).exists() { return Ok(()); }
/// let params = ContextParams { n_seq_max: 2, ..ContextParams::default() };
/// let ctx = Arc::new(Context::open_blocking(path, params)?);
/// let root = Branch::create(&ctx, SamplingParams::greedy())?;
/// assert_eq!(ctx.leases_available(), 1);
/// let kid = root.fork(None)?;
/// assert_eq!(kid.parent()?, Some(root.id()));
/// drop((kid, root)); // both leases come back
/// assert_eq!(ctx.leases_available(), 2);
/// ctx.close_blocking();
/// # Ok::<(), lloyal_core::Error>(())
/// ```
#[derive(Debug)]
pub struct Branch {
    ctx: Arc<Context>,
    id: BranchId,
    /// False once [`Branch::into_id`] gave ownership up.
    owned: bool,
}

impl Branch {
    /// A new root branch with its own lease ([`Context::branch_create`]).
    pub fn create(ctx: &Arc<Context>, params: SamplingParams) -> Result<Branch> {
        let id = ctx.branch_create(params)?;
        Ok(Branch::adopt(ctx, id))
    }

    /// Own a branch made through the id API (a restore, a token tree's
    /// leaves): from now on dropping this handle frees it.
    pub fn adopt(ctx: &Arc<Context>, id: BranchId) -> Branch {
        Branch {
            ctx: Arc::clone(ctx),
            id,
            owned: true,
        }
    }

    /// The id, for the batched `Context::branch_*` calls.
    pub fn id(&self) -> BranchId {
        self.id
    }

    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Give up ownership: the id stays valid and nothing frees it on drop.
    pub fn into_id(mut self) -> BranchId {
        self.owned = false;
        self.id
    }

    /// Whether the branch still exists (not pruned, context open).
    pub fn is_alive(&self) -> bool {
        self.ctx.read_branch(self.id, |_| ()).is_ok()
    }

    /// Read the branch's state, even while an operation is in flight.
    pub fn read<T>(&self, f: impl FnOnce(&BranchState) -> T) -> Result<T> {
        self.ctx.read_branch(self.id, f)
    }

    /// Change the branch's state (`BranchBusy` while an operation is in flight).
    pub fn with<T>(&self, f: impl FnOnce(&mut BranchState) -> Result<T>) -> Result<T> {
        self.ctx.with_branch(self.id, f)
    }

    pub fn parent(&self) -> Result<Option<BranchId>> {
        self.read(|b| b.parent)
    }

    /// A fork ([`Context::branch_fork_at`]), owned like this one.
    pub fn fork(&self, at: Option<i32>) -> Result<Branch> {
        let id = self.ctx.branch_fork_at(self.id, at)?;
        Ok(Branch::adopt(&self.ctx, id))
    }

    /// Leave the parent's children ([`Context::branch_detach`]).
    pub fn detach(&self) -> Result<()> {
        self.ctx.branch_detach(self.id)
    }

    pub fn clear_logits(&self) -> Result<()> {
        self.ctx.branch_clear_logits(self.id)
    }

    pub fn logits_view(&self) -> Result<LogitsView> {
        self.ctx.branch_logits_view(self.id)
    }

    pub fn take_rows(&self) -> Result<Option<Vec<f32>>> {
        self.ctx.branch_take_rows(self.id)
    }

    pub fn produce_is_slow(&self) -> Result<bool> {
        self.ctx.branch_produce_is_slow(self.id)
    }

    pub fn produce(&self) -> Result<i32> {
        self.ctx.branch_produce(self.id)
    }

    pub fn produce_off_thread(&self, reply: Reply<i32>) {
        self.ctx.branch_produce_off_thread(self.id, reply)
    }

    pub fn accept(&self, token: i32) -> Result<()> {
        self.ctx.branch_accept(self.id, token)
    }

    pub fn set_params(&self, params: SamplingParams) -> Result<bool> {
        self.ctx.branch_set_params(self.id, params)
    }

    pub fn reseed(&self, seed: u64) -> Result<()> {
        self.ctx.branch_reseed(self.id, seed)
    }

    pub fn set_logits(&self, logits: &[f32]) -> Result<()> {
        self.ctx.branch_set_logits(self.id, logits)
    }

    pub fn set_logit_bias(&self, biases: Vec<(i32, f32)>) -> Result<()> {
        self.ctx.branch_set_logit_bias(self.id, biases)
    }

    pub fn steer(&self, biases: Vec<(i32, f32)>) -> Result<()> {
        self.ctx.branch_steer(self.id, biases)
    }

    pub fn set_grammar(&self, grammar: Option<Grammar>) -> Result<()> {
        self.ctx.branch_set_grammar(self.id, grammar)
    }

    /// See [`Context::branch_set_adapters`].
    pub fn set_adapters(&self, adapters: crate::adapter::Adapters) -> Result<()> {
        self.ctx.branch_set_adapters(self.id, adapters)
    }

    pub fn sampler_state(&self) -> Result<Vec<u8>> {
        self.ctx.branch_sampler_state(self.id)
    }

    pub fn set_sampler_state(&self, state: &[u8]) -> Result<()> {
        self.ctx.branch_set_sampler_state(self.id, state)
    }

    pub fn truncate(&self, position: i32, logits: Option<Vec<f32>>, reply: Reply<()>) {
        self.ctx.branch_truncate(self.id, position, logits, reply)
    }

    pub fn clear_and_reseed(&self, sinks: Vec<i32>, tail: Vec<i32>, reply: Reply<()>) {
        self.ctx
            .branch_clear_and_reseed(self.id, sinks, tail, reply)
    }

    pub fn save(&self, reply: Reply<Vec<u8>>) {
        self.ctx.branch_save(self.id, reply)
    }

    /// Prune at once when the worker is idle ([`Context::branch_prune_now`]);
    /// `None`: it is busy, call [`Branch::prune`].
    pub fn prune_now(&self, cascade: bool) -> Option<Result<()>> {
        self.ctx.branch_prune_now(self.id, cascade)
    }

    /// Prune ([`Context::branch_prune`]); the handle stays, and its drop
    /// then has nothing to free.
    pub fn prune(&self, cascade: bool, reply: Reply<()>) {
        self.ctx.branch_prune(self.id, cascade, reply)
    }
}

impl Drop for Branch {
    fn drop(&mut self) {
        if self.owned {
            self.ctx.branch_drop(self.id);
        }
    }
}
