//! [`Branch`]: an owned branch, the handle a caller keeps.
//!
//! A `Branch` owns a [`BranchId`] and every one-branch verb (fork, produce,
//! accept, truncate, save, prune...); dropping it without
//! [`Branch::prune`] gives the lease and the cells only it used back, like
//! a file closed on drop. Ids stay public only where many branches go at
//! once (`Context::branch_step`, `branch_commit`, `branch_prefill`,
//! `branch_produce_many`, `read_branch`) and where a branch travels as
//! bytes (`Context::branch_restore`, a cluster's messages): [`Branch::id`]
//! lends one, [`Branch::into_id`] gives ownership up, [`Branch::adopt`]
//! takes it back.

use std::sync::Arc;

use super::tree::TreeOutcome;
use crate::engine::{Context, Reply};
use crate::error::Result;
use crate::grammar::Grammar;
use crate::media::Media;
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

    /// [`Branch::fork`](crate::Branch::fork) of `parent`'s first `at` positions (`0 <=
    /// at <= its position`; `None`: all of them): a fork and a truncate in
    /// one, copying only the cells kept. Below the parent's position the
    /// child has no logits (prefill it next); sampler, metrics and grammar
    /// are cloned as they are, not rewound.
    ///
    /// The child is made here, on the calling thread, and returned at once:
    /// only the copy of the KV cells is work for the worker, queued ahead
    /// of anything submitted on the child afterwards (so a prefill of the
    /// child can follow without waiting) and run between the rounds of any
    /// step in progress -- or here too, when the worker is idle. Until the
    /// copy has run the parent has a fork in flight: forks of it may
    /// follow, any other operation on it fails with `BranchBusy`. Should
    /// the copy fail (a panic), the child is disposed of.
    pub fn fork(&self, at: Option<i32>) -> Result<Branch> {
        let id = self.ctx.branch_fork_at(self.id, at)?;
        Ok(Branch::adopt(&self.ctx, id))
    }

    /// Make the branch a root: it leaves its parent's children, so either
    /// can be pruned first (their KV cells stay shared until then).
    pub fn detach(&self) -> Result<()> {
        self.ctx.branch_detach(self.id)
    }

    /// Drop the branch's logits snapshot (a fork that will be prefilled
    /// before it samples: `produce` refuses until then).
    pub fn clear_logits(&self) -> Result<()> {
        self.ctx.branch_clear_logits(self.id)
    }

    /// The branch's logits snapshot and stats, to compute on without the
    /// branches lock (top tokens, log-probabilities, entropy).
    pub fn logits_view(&self) -> Result<LogitsView> {
        self.ctx.branch_logits_view(self.id)
    }

    /// The logits of every position of the branch's last `prefill` with
    /// `all_rows`, row-major (`n * vocab`), taken (a second call gives
    /// `None`).
    pub fn take_rows(&self) -> Result<Option<Vec<f32>>> {
        self.ctx.branch_take_rows(self.id)
    }

    /// Whether [`Branch::produce`] is slow for this branch (see
    /// `BranchState::produce_is_slow`): callers on an event loop run it on
    /// another thread then.
    pub fn produce_is_slow(&self) -> Result<bool> {
        self.ctx.branch_produce_is_slow(self.id)
    }

    /// Sample the branch's next token; nothing is written.
    pub fn produce(&self) -> Result<i32> {
        self.ctx.branch_produce(self.id)
    }

    /// [`Branch::produce`] on a thread of its own, answering
    /// `reply` from there: for samplers too slow for the caller's thread
    /// ([`Branch::produce_is_slow`]: a 262k-entry sort, a grammar
    /// mask), so that an event loop awaits the token instead of stalling.
    /// The branch is busy until the token is chosen; the sampling runs
    /// without the branches lock, so other branches and the worker's jobs
    /// do not wait behind it.
    pub fn produce_off_thread(&self, reply: Reply<i32>) {
        self.ctx.branch_produce_off_thread(self.id, reply)
    }

    pub fn accept(&self, token: i32) -> Result<()> {
        self.ctx.branch_accept(self.id, token)
    }

    /// Replace the branch's sampling parameters. Returns whether anything
    /// changed; an unchanged call keeps the sampler as it is. A change keeps
    /// the penalty history; the random stream restarts only if the seed
    /// changed.
    pub fn set_params(&self, params: SamplingParams) -> Result<bool> {
        self.ctx.branch_set_params(self.id, params)
    }

    /// Restart the branch's random stream from `seed`.
    pub fn reseed(&self, seed: u64) -> Result<()> {
        self.ctx.branch_reseed(self.id, seed)
    }

    /// Replace a branch's logits snapshot. Entries must be numbers below
    /// +inf (-inf masks a token): a NaN or +inf would make every sampler
    /// pick an arbitrary token (the first one, for greedy).
    pub fn set_logits(&self, logits: &[f32]) -> Result<()> {
        self.ctx.branch_set_logits(self.id, logits)
    }

    pub fn set_logit_bias(&self, biases: Vec<(i32, f32)>) -> Result<()> {
        self.ctx.branch_set_logit_bias(self.id, biases)
    }

    pub fn steer(&self, biases: Vec<(i32, f32)>) -> Result<()> {
        self.ctx.branch_steer(self.id, biases)
    }

    /// Accept a token without decoding it (penalties and metrics).
    /// Replace (or remove) a branch's grammar. Compile it first with
    /// [`crate::Grammar::new`] on this context's model.
    pub fn set_grammar(&self, grammar: Option<Grammar>) -> Result<()> {
        self.ctx.branch_set_grammar(self.id, grammar)
    }

    /// Give branch `id` its own set: its next decodes run under it, and
    /// its forks inherit it. What it decoded before is left as it is (the
    /// KV cells already written were computed under the old set).
    pub fn set_adapters(&self, adapters: crate::adapter::Adapters) -> Result<()> {
        self.ctx.branch_set_adapters(self.id, adapters)
    }

    /// The branch's sampler state (random stream position, penalty
    /// history; see `Sampler::state`), for moving it to another process.
    pub fn sampler_state(&self) -> Result<Vec<u8>> {
        self.ctx.branch_sampler_state(self.id)
    }

    /// Continue the branch's sampling from a state `branch_sampler_state`
    /// gave (bad bytes are an error and change nothing).
    pub fn set_sampler_state(&self, state: &[u8]) -> Result<()> {
        self.ctx.branch_set_sampler_state(self.id, state)
    }

    /// Drop the branch's KV from `position` on (`0 <= position <= its
    /// position`), so it continues from there: a rejected speculative draft,
    /// a backtrack. The logits snapshot becomes `logits` (the distribution
    /// after the last kept token, e.g. a row of `prefill(all_rows)`), or is
    /// cleared. Sampler history, metrics and grammar are not rewound.
    pub fn truncate(&self, position: i32, logits: Option<Vec<f32>>, reply: Reply<()>) {
        self.ctx.branch_truncate(self.id, position, logits, reply)
    }

    /// BlinkKV for a branch: clear its KV and decode `sinks + tail` at
    /// positions from 0. Sampler (penalty history, random stream), grammar,
    /// metrics and children are untouched; the logits become the tail's.
    pub fn clear_and_reseed(&self, sinks: Vec<i32>, tail: Vec<i32>, reply: Reply<()>) {
        self.ctx
            .branch_clear_and_reseed(self.id, sinks, tail, reply)
    }

    /// Snapshot a branch: its KV cells, logits and position, framed like
    /// `kv_cache_save` (model fingerprint + CRC). Sampler state is not
    /// included: a restored branch gets the parameters you give it.
    pub fn save(&self, reply: Reply<Vec<u8>>) {
        self.ctx.branch_save(self.id, reply)
    }

    /// Decode a token tree into `root` in one pass (tree attention): token
    /// `j` follows `parents[j]` (`-1`: the root's last token), at position
    /// `root.position + depth`. A prefix shared by several leaves is decoded
    /// once, its KV cells shared by their sequences (unified KV). Each leaf
    /// ends as a branch holding its path: the root carries the first leaf,
    /// the others are new independent branches (one lease each, forked from
    /// the root before the decode). Every node's logits come back. On a
    /// failed decode the root is as it was and no branch is created.
    pub fn prefill_tree(&self, tokens: Vec<i32>, parents: Vec<i32>, reply: Reply<TreeOutcome>) {
        self.ctx
            .branch_prefill_tree(self.id, tokens, parents, reply)
    }

    /// Keep `keep`'s KV and prune every other branch.
    pub fn retain_only(&self, reply: Reply<()>) {
        self.ctx.branch_retain_only(self.id, reply)
    }

    /// Encode `media` and decode it into branch `id` at its position;
    /// replies with the positions it took. The branch's logits become
    /// those after it when the model closes media with text tokens, and
    /// are cleared otherwise. On any error the branch is as it was.
    pub fn prefill_media(&self, media: Media, reply: Reply<i32>) {
        self.ctx.branch_prefill_media(self.id, media, reply)
    }

    /// [`Branch::prune`] on the calling thread, when the worker is
    /// idle; `None` when it is busy (then call `branch_prune`).
    pub fn prune_now(&self, cascade: bool) -> Option<Result<()>> {
        self.ctx.branch_prune_now(self.id, cascade)
    }

    /// Prune a branch (`cascade`: with its whole subtree), freeing leases.
    /// A prune queues behind operations already in flight on the branch
    /// (the worker runs jobs in order) instead of failing with `BranchBusy`,
    /// so cleanup after a cancelled commit never leaks the lease.
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
