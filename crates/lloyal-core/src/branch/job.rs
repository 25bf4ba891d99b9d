//! Branch jobs: what the worker runs for branch operations, how queued
//! commits merge, and the busy marks that keep a branch to one job at a time.

use super::state::{BranchId, Branches};
use super::tree::TreeOutcome;
use crate::engine::{Recover, Reply, Task, Worker};
use crate::error::{Error, Result};
use crate::sampling::SamplingParams;
use crate::sync::lock;

/// One result per item of a batched operation.
pub type ItemResults = Vec<Result<()>>;

pub(crate) enum BranchJob {
    /// Clear a sequence a new branch leased (it may hold flat-API cells).
    ClearSeq {
        seq: i32,
    },
    Fork {
        parent: BranchId,
        reply: Reply<BranchId>,
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
    Commit {
        items: Vec<(BranchId, i32)>,
        reply: Reply<ItemResults>,
    },
    PrefillTree {
        root: BranchId,
        tokens: Vec<i32>,
        parents: Vec<i32>,
        reply: Reply<TreeOutcome>,
    },
    Prefill {
        items: Vec<(BranchId, Vec<i32>)>,
        /// Keep every position's logits (see `BranchState::rows`), not
        /// only the last token's.
        all_rows: bool,
        reply: Reply<ItemResults>,
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
            BranchJob::Fork { reply, .. } => reply.send(Err(error)),
            BranchJob::Drop { .. } => {}
            BranchJob::Prune { reply, .. } | BranchJob::RetainOnly { reply, .. } => {
                reply.send(Err(error))
            }
            BranchJob::Commit { reply, .. } => reply.send(Err(error)),
            BranchJob::Save { reply, .. } => reply.send(Err(error)),
            BranchJob::Restore { reply, .. } => reply.send(Err(error)),
            BranchJob::Prefill { reply, .. } => reply.send(Err(error)),
            BranchJob::PrefillTree { reply, .. } => reply.send(Err(error)),
            BranchJob::Reseed { reply, .. } | BranchJob::Truncate { reply, .. } => {
                reply.send(Err(error))
            }
        }
    }
}

/// Branch jobs on the engine's worker. Commits absorb the commits queued
/// right behind them (by any callers: tasks, threads, event loops): one
/// commit, so one decode, each caller still getting its own items' results.
/// (Their branches are distinct: a branch with a commit in flight is busy
/// and refuses another.)
impl Task for BranchJob {
    fn run(self: Box<Self>, worker: &mut Worker<'_>) {
        worker.execute_branch(*self);
    }

    fn fail(self: Box<Self>, error: Error) {
        BranchJob::fail(*self, error);
    }

    fn recover(&self) -> Option<Recover> {
        let busy = self.busy_ids();
        (!busy.is_empty()).then(|| -> Recover {
            Box::new(move |w: &mut Worker<'_>| clear_busy(&mut lock(&w.shared.branches), busy))
        })
    }

    fn absorb(&mut self, next: Box<dyn Task>) -> std::result::Result<(), Box<dyn Task>> {
        let both_commits = matches!(self, BranchJob::Commit { .. })
            && matches!(
                (*next).as_any().downcast_ref::<BranchJob>(),
                Some(BranchJob::Commit { .. })
            );
        if !both_commits {
            return Err(next);
        }
        let Ok(next) = next.into_any().downcast::<BranchJob>() else {
            unreachable!("checked above");
        };
        let (
            BranchJob::Commit {
                items: first,
                reply: r0,
            },
            BranchJob::Commit { items, reply },
        ) = (self, *next)
        else {
            unreachable!("checked above");
        };
        let split = first.len();
        first.extend(items);
        let r1 = std::mem::replace(r0, Reply::new(|_| {}));
        *r0 = Reply::new(move |result: Result<ItemResults>| match result {
            Ok(mut all) => {
                let rest = all.split_off(split.min(all.len()));
                r1.send(Ok(all));
                reply.send(Ok(rest));
            }
            Err(e) => {
                r1.send(Err(e.clone()));
                reply.send(Err(e));
            }
        });
        Ok(())
    }
}

impl BranchJob {
    /// The branches this job marked busy when it was submitted (so a job
    /// that panicked can free them).
    pub(crate) fn busy_ids(&self) -> Vec<BranchId> {
        match self {
            BranchJob::Fork { parent: id, .. }
            | BranchJob::Save { id, .. }
            | BranchJob::Reseed { id, .. }
            | BranchJob::Truncate { id, .. }
            | BranchJob::RetainOnly { keep: id, .. }
            | BranchJob::PrefillTree { root: id, .. } => vec![*id],
            BranchJob::Commit { items, .. } => items.iter().map(|i| i.0).collect(),
            BranchJob::Prefill { items, .. } => items.iter().map(|i| i.0).collect(),
            BranchJob::ClearSeq { .. }
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
        if branches.get(id)?.busy || ids[..i].contains(&id) {
            return Err(Error::BranchBusy);
        }
    }
    for &id in ids {
        branches.get_mut(id)?.busy = true;
    }
    Ok(())
}

pub(super) fn clear_busy(branches: &mut Branches, ids: impl IntoIterator<Item = BranchId>) {
    for id in ids {
        if let Ok(b) = branches.get_mut(id) {
            b.busy = false;
        }
    }
}

impl Worker<'_> {
    pub(crate) fn execute_branch(&mut self, job: BranchJob) {
        match job {
            BranchJob::ClearSeq { seq } => {
                let _ = self.remove_cells(seq, None, None);
                self.refresh_seq(seq);
            }
            BranchJob::Fork { parent, reply } => {
                let result = self.fork(parent);
                clear_busy(&mut lock(&self.shared.branches), [parent]);
                reply.send(result);
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
                clear_busy(&mut lock(&self.shared.branches), [id]);
                reply.send(result);
            }
            BranchJob::Restore {
                data,
                params,
                reply,
            } => reply.send(self.restore_branch(&data, params)),
            BranchJob::Reseed { id, tokens, reply } => {
                let result = self.reseed(id, tokens);
                clear_busy(&mut lock(&self.shared.branches), [id]);
                reply.send(result);
            }
            BranchJob::Truncate {
                id,
                position,
                logits,
                reply,
            } => {
                let result = self.truncate(id, position, logits);
                clear_busy(&mut lock(&self.shared.branches), [id]);
                reply.send(result);
            }
            BranchJob::RetainOnly { keep, reply } => {
                let result = self.retain_only(keep);
                clear_busy(&mut lock(&self.shared.branches), [keep]);
                reply.send(result);
            }
            // (A panic here is the worker loop's: see `context::run`.)
            BranchJob::Commit { items, reply } => {
                let ids: Vec<BranchId> = items.iter().map(|&(id, _)| id).collect();
                let result = self.commit(&items);
                clear_busy(&mut lock(&self.shared.branches), ids);
                reply.send(result);
            }
            BranchJob::PrefillTree {
                root,
                tokens,
                parents,
                reply,
            } => {
                let result = self.prefill_tree(root, &tokens, &parents);
                clear_busy(&mut lock(&self.shared.branches), [root]);
                reply.send(result);
            }
            BranchJob::Prefill {
                items,
                all_rows,
                reply,
            } => {
                let ids: Vec<BranchId> = items.iter().map(|(id, _)| *id).collect();
                let result = self.prefill(&items, all_rows);
                clear_busy(&mut lock(&self.shared.branches), ids);
                reply.send(result);
            }
        }
    }
}
