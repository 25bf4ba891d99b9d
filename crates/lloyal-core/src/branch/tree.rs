//! Token trees: many sequences sharing tokens, prefilled in one decode.

use std::sync::Arc;

use llama_cpp_2::token::LlamaToken;

use crate::engine::Worker;
use crate::error::{invalid, Error, Result};
use crate::state::BranchId;
use crate::sync::lock;

/// What [`Branch::prefill_tree`](crate::Branch::prefill_tree)(crate::Context::branch_prefill_tree) gives back.
#[derive(Debug)]
pub struct TreeOutcome {
    /// One branch per leaf of the tree, in node order: `(leaf node,
    /// branch)`. The root branch carries the first leaf; the others are new
    /// branches with leases of their own and no parent.
    pub leaves: Vec<(usize, BranchId)>,
    /// Every node's logits, row-major (`tokens.len() * vocab`).
    pub rows: Vec<f32>,
    pub vocab: usize,
}

/// A token tree is well formed: one parent per token, each `-1` (the
/// root branch's last token) or an earlier token.
pub(super) fn check_tree(tokens: &[i32], parents: &[i32]) -> Result<()> {
    if tokens.is_empty() {
        return Err(invalid("cannot prefill an empty token tree"));
    }
    if tokens.len() != parents.len() {
        return Err(invalid(format!(
            "a token tree needs one parent per token: {} tokens, {} parents",
            tokens.len(),
            parents.len()
        )));
    }
    for (j, &p) in parents.iter().enumerate() {
        if p < -1 || p >= j as i32 {
            return Err(invalid(format!(
                "parents[{j}] must be -1 (the root) or an earlier token's index, got {p}"
            )));
        }
    }
    Ok(())
}

impl Worker<'_> {
    pub(super) fn prefill_tree(
        &mut self,
        root: BranchId,
        tokens: &[i32],
        parents: &[i32],
    ) -> Result<TreeOutcome> {
        let n = tokens.len();
        let mut depth = vec![0i32; n];
        let mut inner = vec![false; n];
        for (j, &p) in parents.iter().enumerate() {
            if let Ok(p) = usize::try_from(p) {
                depth[j] = depth[p] + 1;
                inner[p] = true;
            }
        }
        let leaves: Vec<usize> = (0..n).filter(|&j| !inner[j]).collect();
        let base = lock(&self.shared.branches).get(root)?.position;
        // A branch per leaf: the root for the first, forks for the others
        // (sharing the root's cells), made independent of the root.
        let mut ids = vec![root];
        for _ in 1..leaves.len() {
            match self.fork(root) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    self.drop_tree(root, base, &ids[1..]);
                    return Err(e);
                }
            }
        }
        let seqs: Vec<i32> = {
            let mut branches = lock(&self.shared.branches);
            branches
                .get_mut(root)?
                .children
                .retain(|c| !ids[1..].contains(c));
            let mut seqs = Vec::with_capacity(ids.len());
            for &id in &ids {
                let b = branches.get_mut(id)?;
                if id != root {
                    b.parent = None;
                }
                seqs.push(b.seq);
            }
            seqs
        };
        // Each node's sequences: those of the leaves below it.
        let mut node_seqs: Vec<Vec<i32>> = vec![Vec::new(); n];
        for (&leaf, &seq) in leaves.iter().zip(&seqs) {
            let mut j = leaf as i32;
            while j >= 0 {
                node_seqs[j as usize].push(seq);
                j = parents[j as usize];
            }
        }
        let vocab = self.model.vocab_size() as usize;
        let mut rows: Vec<f32> = Vec::with_capacity(n * vocab);
        // The leaves are forks of the root: they decode under its set.
        let set = lock(&self.shared.branches)
            .get(root)
            .map(|b| b.adapters.clone())
            .unwrap_or_default();
        if let Err(e) = self.use_adapters(&set) {
            self.drop_tree(root, base, &ids[1..]);
            return Err(e);
        }
        self.batch.clear();
        for j in 0..n {
            let added = self
                .batch
                .add(LlamaToken(tokens[j]), base + depth[j], &node_seqs[j], true)
                .map_err(|e| Error::Internal(format!("batch add: {e}")));
            let decoded = added.and_then(|()| {
                if self.batch.n_tokens() as usize == self.n_batch || j + 1 == n {
                    self.llama_decode(self.batch.n_tokens() as usize)?;
                    for r in 0..self.batch.n_tokens() {
                        rows.extend_from_slice(self.ctx.get_logits_ith(r));
                    }
                    self.batch.clear();
                }
                Ok(())
            });
            if let Err(e) = decoded {
                self.batch.clear();
                self.drop_tree(root, base, &ids[1..]);
                return Err(e);
            }
        }
        for &seq in &seqs {
            self.refresh_seq(seq);
        }
        let mut branches = lock(&self.shared.branches);
        for (&leaf, &id) in leaves.iter().zip(&ids) {
            let b = branches.get_mut(id)?;
            b.position = base + depth[leaf] + 1;
            b.rows = None;
            b.set_logits(Arc::from(&rows[leaf * vocab..(leaf + 1) * vocab]));
        }
        Ok(TreeOutcome {
            leaves: leaves.into_iter().zip(ids).collect(),
            rows,
            vocab,
        })
    }

    /// Undo a failed tree: the root's cells from `base` on, and the forks.
    pub(super) fn drop_tree(&mut self, root: BranchId, base: i32, forks: &[BranchId]) {
        let (removed, root_seq) = {
            let mut branches = lock(&self.shared.branches);
            let removed: Vec<_> = forks
                .iter()
                .filter_map(|&id| branches.remove(id).ok())
                .collect();
            let root_seq = branches.get_mut(root).ok().map(|b| {
                b.children.retain(|c| !forks.contains(c));
                b.seq
            });
            (removed, root_seq)
        };
        self.dispose(removed);
        if let Some(seq) = root_seq {
            let _ = self.remove_cells(seq, u32::try_from(base).ok(), None);
            self.refresh_seq(seq);
        }
    }
}
