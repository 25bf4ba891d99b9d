//! Branch jobs: what the worker runs for branch operations other than
//! decoding tokens (commits and prefills are steps: `engine::step`), and the
//! busy marks that keep a branch to one job at a time.

use super::tree::TreeOutcome;
use crate::engine::{Recover, Reply, Task, Worker};
use crate::error::{Error, Result};
use crate::sampling::SamplingParams;
use crate::state::{BranchId, Branches};
use crate::sync::lock;

pub(crate) enum BranchJob {
    /// Clear a sequence a new branch leased (it may hold flat-API cells).
    ClearSeq {
        seq: i32,
    },
    /// The KV cells of a fork made on the caller's thread
    /// (`Context::branch_fork_at`): `src`'s positions `0..end` into `dst`.
    /// Its `parent` has a fork in flight (`BranchState::forks`) until then.
    CopyFork {
        parent: BranchId,
        child: BranchId,
        src: i32,
        dst: i32,
        end: i32,
    },
    Prune {
        id: BranchId,
        cascade: bool,
        reply: Reply<()>,
    },
    /// A branch nobody holds any more: free it, its children become roots.
    Drop {
        id: BranchId,
    },
    PrefillTree {
        root: BranchId,
        tokens: Vec<i32>,
        parents: Vec<i32>,
        reply: Reply<TreeOutcome>,
    },
    RetainOnly {
        keep: BranchId,
        reply: Reply<()>,
    },
    Save {
        id: BranchId,
        reply: Reply<Vec<u8>>,
    },
    Restore {
        data: Vec<u8>,
        params: SamplingParams,
        reply: Reply<BranchId>,
    },
    Reseed {
        id: BranchId,
        tokens: Vec<i32>,
        reply: Reply<()>,
    },
    Truncate {
        id: BranchId,
        position: i32,
        logits: Option<Vec<f32>>,
        reply: Reply<()>,
    },
}

impl BranchJob {
    pub(crate) fn fail(self, error: Error) {
        match self {
            BranchJob::ClearSeq { .. } => {}
            BranchJob::CopyFork { .. } => {}
            BranchJob::Drop { .. } => {}
            BranchJob::Prune { reply, .. } | BranchJob::RetainOnly { reply, .. } => {
                reply.send(Err(error))
            }
            BranchJob::Save { reply, .. } => reply.send(Err(error)),
            BranchJob::Restore { reply, .. } => reply.send(Err(error)),
            BranchJob::PrefillTree { reply, .. } => reply.send(Err(error)),
            BranchJob::Reseed { reply, .. } | BranchJob::Truncate { reply, .. } => {
                reply.send(Err(error))
            }
        }
    }
}

/// Branch jobs on the engine's worker.
impl Task for BranchJob {
    fn run(self: Box<Self>, worker: &mut Worker<'_>) {
        worker.execute_branch(*self);
    }

    fn fail(self: Box<Self>, error: Error) {
        BranchJob::fail(*self, error);
    }

    /// Forks, truncations, saves and prunes of branches outside the step
    /// in progress are quick and independent of it: they run between its
    /// rounds (a request's fork does not wait for a long prompt's prefill).
    fn overtakes(&self, worker: &Worker<'_>, step: &[BranchId]) -> bool {
        let touched = match self {
            BranchJob::CopyFork { parent, child, .. } => vec![*parent, *child],
            BranchJob::Truncate { id, .. }
            | BranchJob::Save { id, .. }
            | BranchJob::Drop { id }
            | BranchJob::Prune {
                id, cascade: false, ..
            } => vec![*id],
            BranchJob::Prune {
                id, cascade: true, ..
            } => match lock(&worker.shared.branches).subtree_post_order(*id) {
                Ok(ids) => ids,
                Err(_) => vec![*id],
            },
            _ => return false,
        };
        !touched.iter().any(|id| step.contains(id))
    }

    fn recover(&self) -> Option<Recover> {
        if let BranchJob::CopyFork { parent, child, .. } = *self {
            // The child has no cells it can trust: dispose of it.
            return Some(Box::new(move |w: &mut Worker<'_>| {
                let removed = {
                    let mut branches = lock(&w.shared.branches);
                    end_fork(&mut branches, parent);
                    if let Ok(p) = branches.get_mut(parent) {
                        p.children.retain(|&c| c != child);
                    }
                    branches.detach_children(child);
                    branches.remove(child).ok()
                };
                w.dispose(removed.into_iter().collect());
            }));
        }
        let busy = self.busy_ids();
        (!busy.is_empty()).then(|| -> Recover {
            Box::new(move |w: &mut Worker<'_>| lock(&w.shared.branches).clear_busy(busy))
        })
    }
}

impl BranchJob {
    /// The branches this job marked busy when it was submitted (so a job
    /// that panicked can free them).
    pub(crate) fn busy_ids(&self) -> Vec<BranchId> {
        match self {
            BranchJob::Save { id, .. }
            | BranchJob::Reseed { id, .. }
            | BranchJob::Truncate { id, .. }
            | BranchJob::RetainOnly { keep: id, .. }
            | BranchJob::PrefillTree { root: id, .. } => vec![*id],
            BranchJob::ClearSeq { .. }
            | BranchJob::CopyFork { .. }
            | BranchJob::Prune { .. }
            | BranchJob::Drop { .. }
            | BranchJob::Restore { .. } => Vec::new(),
        }
    }
}

/// Mark `ids` busy, or fail (marking nothing) if any is stale or busy, or
/// appears twice.
pub(super) fn mark_busy(branches: &mut Branches, ids: &[BranchId]) -> Result<()> {
    for (i, &id) in ids.iter().enumerate() {
        if branches.get(id)?.is_busy() || ids[..i].contains(&id) {
            return Err(Error::BranchBusy);
        }
    }
    for &id in ids {
        branches.get_mut(id)?.busy = true;
    }
    Ok(())
}

/// Count a fork of `parent` as finished (see `BranchState::forks`).
pub(super) fn end_fork(branches: &mut Branches, parent: BranchId) {
    if let Ok(p) = branches.get_mut(parent) {
        p.forks = p.forks.saturating_sub(1);
    }
}

impl Worker<'_> {
    pub(crate) fn execute_branch(&mut self, job: BranchJob) {
        match job {
            BranchJob::ClearSeq { seq } => {
                let _ = self.remove_cells(seq, None, None);
                self.refresh_seq(seq);
            }
            BranchJob::CopyFork {
                parent,
                src,
                dst,
                end,
                ..
            } => {
                self.copy_fork(src, dst, end);
                end_fork(&mut lock(&self.shared.branches), parent);
            }
            BranchJob::Prune { id, cascade, reply } => {
                // The branch was alive when the prune was submitted; if a job
                // queued ahead of it (retain_only, an ancestor's cascade) has
                // disposed of it since, what the prune asked for is done.
                reply.send(match self.prune(id, cascade) {
                    Err(Error::BranchDisposed) => Ok(()),
                    result => result,
                })
            }
            BranchJob::Drop { id } => {
                let removed = {
                    let mut branches = lock(&self.shared.branches);
                    branches.detach_children(id);
                    branches.remove(id)
                };
                if let Ok(state) = removed {
                    self.dispose(vec![state]);
                }
            }
            BranchJob::Save { id, reply } => {
                let result = self.save_branch(id);
                lock(&self.shared.branches).clear_busy([id]);
                reply.send(result);
            }
            BranchJob::Restore {
                data,
                params,
                reply,
            } => reply.send(self.restore_branch(&data, params)),
            BranchJob::Reseed { id, tokens, reply } => {
                let result = self.reseed(id, tokens);
                lock(&self.shared.branches).clear_busy([id]);
                reply.send(result);
            }
            BranchJob::Truncate {
                id,
                position,
                logits,
                reply,
            } => {
                let result = self.truncate(id, position, logits);
                lock(&self.shared.branches).clear_busy([id]);
                reply.send(result);
            }
            BranchJob::RetainOnly { keep, reply } => {
                let result = self.retain_only(keep);
                lock(&self.shared.branches).clear_busy([keep]);
                reply.send(result);
            }
            BranchJob::PrefillTree {
                root,
                tokens,
                parents,
                reply,
            } => {
                let result = self.prefill_tree(root, &tokens, &parents);
                lock(&self.shared.branches).clear_busy([root]);
                reply.send(result);
            }
        }
    }
}
