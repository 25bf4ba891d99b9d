//! Worker-side branch operations that change KV sequences: fork, prune,
//! retain, reseed, truncate.

use std::sync::Arc;

use crate::engine::step::Input;
use crate::engine::{Shared, Worker};
use crate::error::{invalid, Error, Result};
use crate::state::{BranchId, BranchState, Branches};
use crate::sync::lock;

impl Worker<'_> {
    pub(crate) fn refresh_seq(&self, seq: i32) {
        if let Ok(slot) = usize::try_from(seq) {
            self.refresh_pos(slot, seq);
        }
    }

    // The KV work below (copies, removals: scans of every cell) runs
    // without the branches lock, so that callers reading branch state on
    // other threads do not wait behind it. A branch being forked is busy
    // (or the worker is idle: inline), and leases taken or not yet given
    // back keep their sequences from anyone else meanwhile.

    /// The KV work of a fork (`Context::branch_fork_at`): `dst` holds
    /// `src`'s positions `0..end`. The lease may hold flat-API cells; a
    /// fork starts from its parent's (`seq_rm` scans every cell, so it is
    /// skipped when the sequence is empty).
    pub(super) fn copy_fork(&mut self, src: i32, dst: i32, end: i32) {
        if self.ctx.kv_cache_seq_pos_max(dst) >= 0 {
            let _ = self.remove_cells(dst, None, None);
        }
        if end > 0 {
            // Fails only on positions beyond i32, which a branch never has.
            let _ = self
                .ctx
                .copy_kv_cache_seq(src, dst, None, u32::try_from(end).ok());
        }
        self.refresh_seq(dst);
    }

    /// A fork made on the worker, with its cells (`prefill_tree`).
    pub(super) fn fork(&mut self, parent: BranchId) -> Result<BranchId> {
        let made = make_fork(&mut lock(&self.shared.branches), &self.shared, parent, None)?;
        self.copy_fork(made.src, made.dst, made.end);
        Ok(made.child)
    }

    /// Clear the cells of branches taken out of the arena, then give their
    /// leases back (a lease is free only once its cells are).
    pub(super) fn dispose(&mut self, removed: Vec<BranchState>) {
        // The states go first: dropped after the removal instead, they made
        // the next fork 14 us slower at 3,000 cells (SmolLM2, measured:
        // bench/branching.py fork latency).
        let seqs: Vec<i32> = removed.iter().map(|s| s.seq).collect();
        drop(removed);
        for &seq in &seqs {
            let _ = self.remove_cells(seq, None, None);
            self.refresh_seq(seq);
        }
        let mut branches = lock(&self.shared.branches);
        for &seq in &seqs {
            branches.release(seq);
        }
    }

    pub(super) fn prune(&mut self, id: BranchId, cascade: bool) -> Result<()> {
        let removed = {
            let mut branches = lock(&self.shared.branches);
            let order = if cascade {
                branches.subtree_post_order(id)?
            } else {
                let live = branches.get(id)?.children.len();
                if live > 0 {
                    return Err(invalid(format!(
                        "the branch has {live} live children; prune them first or use prune_subtree()"
                    )));
                }
                vec![id]
            };
            // Everything submitted before this prune has run; an operation
            // submitted after it finds the branch gone (BranchDisposed).
            order
                .into_iter()
                .filter_map(|b| branches.remove(b).ok())
                .collect()
        };
        self.dispose(removed);
        Ok(())
    }

    pub(super) fn retain_only(&mut self, keep: BranchId) -> Result<()> {
        let (keep_seq, removed, flat_cells) = {
            let mut branches = lock(&self.shared.branches);
            let keep_seq = branches.get(keep)?.seq;
            let others: Vec<BranchId> = branches.ids().into_iter().filter(|&b| b != keep).collect();
            if others
                .iter()
                .any(|&b| branches.get(b).is_ok_and(|s| s.is_busy()))
            {
                return Err(Error::BranchBusy);
            }
            let n_seq = branches.n_seq_max() as i32;
            let flat_cells =
                (0..n_seq).any(|s| !branches.is_leased(s) && self.ctx.kv_cache_seq_pos_max(s) >= 0);
            let removed: Vec<BranchState> = others
                .into_iter()
                .filter_map(|b| branches.remove(b).ok())
                .collect();
            let winner = branches.get_mut(keep)?;
            winner.parent = None;
            winner.children.clear();
            (keep_seq, removed, flat_cells)
        };
        // One pass over the cells (keep only the winner's sequence), unless
        // the flat API holds cells in a sequence no branch leases, or
        // removed cells become tombstones: then clear the losers' sequences
        // one by one and leave those alone.
        if flat_cells || self.tomb().is_some() {
            self.dispose(removed);
        } else {
            self.ctx.llama_kv_cache_seq_keep(keep_seq);
            let mut branches = lock(&self.shared.branches);
            for state in &removed {
                branches.release(state.seq);
            }
        }
        for seq in 0..self.shared_pos_len() {
            self.refresh_seq(seq);
        }
        Ok(())
    }

    /// Empty the branch's sequence, then prefill `tokens` from position 0.
    /// If that decode fails the branch is left empty (position 0, no
    /// logits) and the error says why; nothing else changes.
    pub(super) fn reseed(&mut self, id: BranchId, tokens: Vec<i32>) -> Result<()> {
        let seq = {
            let mut branches = lock(&self.shared.branches);
            let b = branches.get_mut(id)?;
            b.position = 0;
            b.clear_logits();
            b.seq
        };
        let _ = self.remove_cells(seq, None, None);
        self.refresh_seq(seq);
        match self
            .run_group(vec![(id, Input::Prefill(tokens))], false)?
            .pop()
        {
            Some(result) => result,
            None => Ok(()),
        }
    }

    pub(super) fn truncate(
        &mut self,
        id: BranchId,
        position: i32,
        logits: Option<Vec<f32>>,
    ) -> Result<()> {
        let seq = lock(&self.shared.branches).get(id)?.seq;
        self.remove_cells(seq, u32::try_from(position).ok(), None)?;
        self.refresh_seq(seq);
        let mut branches = lock(&self.shared.branches);
        let b = branches.get_mut(id)?;
        b.position = position;
        b.rows = None;
        match logits {
            Some(l) => b.set_logits(Arc::from(l)),
            None => b.clear_logits(),
        }
        Ok(())
    }
}

/// `at` of a fork of a branch at `position`: `0..=position`, or `None`.
pub(super) fn check_fork_at(position: i32, at: Option<i32>) -> Result<()> {
    match at {
        Some(at) if !(0..=position).contains(&at) => Err(invalid(format!(
            "at must be in [0, {position}] (the branch's position), got {at}"
        ))),
        _ => Ok(()),
    }
}

/// A fork whose state is in the arena and whose KV cells are still to be
/// copied (`Worker::copy_fork`): `src`'s positions `0..end` into `dst`.
pub(super) struct MadeFork {
    pub(super) child: BranchId,
    pub(super) src: i32,
    pub(super) dst: i32,
    pub(super) end: i32,
}

/// Make a fork of `parent`'s first `at` positions (all with `None`) in the
/// arena: a lease, a clone of the parent's state as of now, the links
/// between them. No KV work: the caller copies the cells next.
pub(super) fn make_fork(
    branches: &mut Branches,
    shared: &Shared,
    parent: BranchId,
    at: Option<i32>,
) -> Result<MadeFork> {
    let p = branches.get(parent)?;
    check_fork_at(p.position, at)?;
    let (src, full) = (p.seq, p.position);
    let end = at.unwrap_or(full);
    let dst = branches.lease(|s| shared.holds_flat_data(s))?;
    let mut state = branches.get(parent)?.fork(dst, parent);
    if end < full {
        state.position = end;
        state.fork_head = end;
        state.clear_logits();
    }
    let child = branches.insert(state);
    branches.get_mut(parent)?.children.push(child);
    Ok(MadeFork {
        child,
        src,
        dst,
        end,
    })
}
