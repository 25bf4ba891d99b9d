//! Steps: every decode of branch tokens goes through one.
//!
//! A step is a list of groups, a group being one caller's batch: one
//! `branch_commit`, one `branch_prefill`, or what one Python event-loop tick
//! issued. Each group's items are commits (one token, accepted by the
//! branch's sampler, grammar and perplexity first) or prefills (a token
//! list). The worker merges the steps queued back to back into one and runs
//! it in rounds (`rounds`), each round one decode of at most
//! `n_batch` tokens where it can: every commit waiting, then prompt tokens
//! in arrival order to fill the batch (chunked prefill). A long prompt so
//! takes several rounds, and the commits that arrive meanwhile join the
//! next round instead of waiting for the whole prompt.
//!
//! The failure rules, written once:
//! - a group is all or nothing: when its tokens do not fit the KV cache,
//!   every branch in it is put back as it was (position, KV cells, sampler,
//!   grammar, perplexity, logits) and the group fails with `KvCacheFull`;
//! - groups are isolated: when a round does not fit, its groups are split
//!   in halves and retried, so the groups that fit land and only the others
//!   fail. An item that fails on its own before decoding (a branch pruned
//!   meanwhile, a token its grammar refuses) fails alone;
//! - a group whose caller gave up (`Reply::cancel_with`) and that has not
//!   finished is failed at the start of the next round with `Cancelled`,
//!   and undone like a group that did not fit.

use std::sync::Arc;

use super::reply::Reply;
use crate::error::{Error, Result};
use crate::grammar::Grammar;
use crate::metrics::{LogitStats, PerplexityTracker};
use crate::sampling::Sampler;
use crate::state::{BranchId, BranchState};

/// One result per item of a group.
pub type ItemResults = Vec<Result<()>>;

/// One caller's batch for [`Context::branch_step`](crate::Context::branch_step):
/// its items, whether to keep every position's logits of its prefills, and
/// the reply that gets one result per item.
pub type StepGroup = (Vec<(BranchId, Input)>, bool, Reply<ItemResults>);

/// What an item of a step decodes into its branch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// Accept this token, then decode it.
    Commit(i32),
    /// Decode these tokens (at least one).
    Prefill(Vec<i32>),
}

/// One caller's batch: all or nothing (see the module docs).
pub(crate) struct Group {
    /// Taken by the worker when the group first runs.
    pub(crate) items: Vec<(BranchId, Input)>,
    /// Its items' branches, which its caller marked busy.
    pub(crate) ids: Vec<BranchId>,
    /// Keep every position's logits (see `BranchState::rows`), not only
    /// the last token's.
    pub(crate) all_rows: bool,
    pub(crate) reply: Reply<ItemResults>,
    /// Filled by the worker when the group first runs.
    pub(crate) progress: Option<Progress>,
}

impl Group {
    pub(crate) fn new(
        items: Vec<(BranchId, Input)>,
        all_rows: bool,
        reply: Reply<ItemResults>,
    ) -> Self {
        Group {
            ids: items.iter().map(|(id, _)| *id).collect(),
            items,
            all_rows,
            reply,
            progress: None,
        }
    }
}

/// A group on its way: its items' results so far, what it decodes, and
/// what to put back if it fails.
pub(crate) struct Progress {
    pub(crate) results: ItemResults,
    pub(crate) work: Vec<Work>,
    pub(crate) undo: Vec<Undo>,
    /// Why the group failed, once it has.
    pub(crate) failed: Option<Error>,
}

impl Progress {
    pub(crate) fn finished(&self) -> bool {
        self.failed.is_some() || self.work.iter().all(|w| w.decoded == w.tokens.len())
    }
}

/// An item being decoded.
pub(crate) struct Work {
    pub(crate) id: BranchId,
    pub(crate) seq: i32,
    /// Where its first token goes.
    pub(crate) start: i32,
    pub(crate) tokens: Vec<i32>,
    /// Tokens decoded in earlier rounds.
    pub(crate) decoded: usize,
    pub(crate) commit: bool,
    /// Whether its sampler wants the argmax of its new logits.
    pub(crate) greedy: bool,
    /// Its new logits, once its last token is decoded.
    pub(crate) fresh: Option<(Arc<[f32]>, LogitStats)>,
    /// Every position's logits, with `all_rows`.
    pub(crate) rows: Vec<f32>,
    /// The adapter set its branch decodes under.
    pub(crate) adapters: crate::adapter::Adapters,
}

/// What a failed group puts back into a branch.
pub(crate) struct Undo {
    pub(crate) id: BranchId,
    pub(crate) seq: i32,
    pub(crate) position: i32,
    pub(crate) sampler: Sampler,
    pub(crate) perplexity: PerplexityTracker,
    pub(crate) sampling_perplexity: PerplexityTracker,
    /// Tokens the branch's grammar had consumed before the group.
    pub(crate) grammar_consumed: Option<usize>,
}

impl Undo {
    pub(crate) fn of(id: BranchId, b: &BranchState) -> Self {
        Undo {
            id,
            seq: b.seq,
            position: b.position,
            sampler: b.sampler().clone(),
            perplexity: b.perplexity.clone(),
            sampling_perplexity: b.sampling_perplexity.clone(),
            grammar_consumed: b.grammar().map(Grammar::consumed),
        }
    }
}

/// Groups the worker runs together (see the module docs).
#[derive(Default)]
pub(crate) struct Step {
    pub(crate) groups: Vec<Group>,
}

impl Step {
    pub(crate) fn new(groups: Vec<Group>) -> Self {
        Step { groups }
    }

    /// Every branch of every group (marked busy by their callers).
    pub(crate) fn ids(&self) -> Vec<BranchId> {
        self.groups
            .iter()
            .flat_map(|g| g.ids.iter().copied())
            .collect()
    }

    /// Take `other`'s groups after this step's own.
    pub(crate) fn extend(&mut self, other: Step) {
        self.groups.extend(other.groups);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Answer every group with `error` without running it.
    pub(crate) fn fail(self, error: Error) {
        for g in self.groups {
            g.reply.send(Err(error.clone()));
        }
    }
}
