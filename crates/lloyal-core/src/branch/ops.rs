//! Worker-side branch operations that change KV sequences: fork, prune,
//! retain, reseed, truncate.

use std::sync::Arc;

use super::state::{BranchId, Branches};
use crate::engine::Worker;
use crate::error::{invalid, Error, Result};
use crate::sync::lock;

impl Worker<'_> {
    pub(super) fn refresh_seq(&self, seq: i32) {
        if let Ok(slot) = usize::try_from(seq) {
            self.refresh_pos(slot, seq);
        }
    }

    pub(super) fn fork(&mut self, parent: BranchId) -> Result<BranchId> {
        let shared = Arc::clone(&self.shared);
        let mut branches = lock(&shared.branches);
        let (src, position) = {
            let p = branches.get(parent)?;
            (p.seq, p.position)
        };
        let dst = branches.lease(|s| shared.holds_flat_data(s))?;
        // The lease may hold flat-API cells; a fork starts from the parent's.
        // (`seq_rm` scans every cell, so skip it when the sequence is empty.)
        if self.ctx.kv_cache_seq_pos_max(dst) >= 0 {
            let _ = self.remove_cells(dst, None, None);
        }
        if position > 0 {
            self.ctx
                .copy_kv_cache_seq(src, dst, None, None)
                .map_err(|e| {
                    branches.release(dst);
                    Error::Internal(format!("KV sequence copy failed: {e}"))
                })?;
        }
        let child = branches.get(parent)?.fork(dst, parent);
        let id = branches.insert(child);
        branches.get_mut(parent)?.children.push(id);
        drop(branches);
        self.refresh_seq(dst);
        Ok(id)
    }

    /// Clear a removed branch's cells and give its lease back.
    pub(super) fn dispose(&mut self, branches: &mut Branches, id: BranchId) -> Result<()> {
        let state = branches.remove(id)?;
        let _ = self.remove_cells(state.seq, None, None);
        branches.release(state.seq);
        self.refresh_seq(state.seq);
        Ok(())
    }

    pub(super) fn prune(&mut self, id: BranchId, cascade: bool) -> Result<()> {
        let shared = Arc::clone(&self.shared);
        let mut branches = lock(&shared.branches);
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
        for b in order {
            self.dispose(&mut branches, b)?;
        }
        Ok(())
    }

    pub(super) fn retain_only(&mut self, keep: BranchId) -> Result<()> {
        let shared = Arc::clone(&self.shared);
        let mut branches = lock(&shared.branches);
        let keep_seq = branches.get(keep)?.seq;
        let others: Vec<BranchId> = branches.ids().into_iter().filter(|&b| b != keep).collect();
        if others
            .iter()
            .any(|&b| branches.get(b).is_ok_and(|s| s.busy))
        {
            return Err(Error::BranchBusy);
        }
        // One pass over the cells (keep only the winner's sequence), unless
        // the flat API holds cells in a sequence no branch leases, or
        // removed cells become tombstones: then clear the losers' sequences
        // one by one and leave those alone.
        let n_seq = branches.n_seq_max() as i32;
        let flat_cells =
            (0..n_seq).any(|s| !branches.is_leased(s) && self.ctx.kv_cache_seq_pos_max(s) >= 0);
        if flat_cells || self.tomb().is_some() {
            for &b in &others {
                let seq = branches.get(b)?.seq;
                let _ = self.remove_cells(seq, None, None);
            }
        } else {
            self.ctx.llama_kv_cache_seq_keep(keep_seq);
        }
        for b in others {
            let state = branches.remove(b)?;
            branches.release(state.seq);
        }
        let winner = branches.get_mut(keep)?;
        winner.parent = None;
        winner.children.clear();
        drop(branches);
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
        match self.prefill(&[(id, tokens)], false)?.pop() {
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
