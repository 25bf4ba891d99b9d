//! The batched branch operations callers start: steps (commits and
//! prefills of many branches, see `engine::step`) and choosing the next
//! token of many branches in one call.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

use crate::engine::step::{Group, Input, ItemResults, Step, StepGroup};
use crate::engine::{Context, Job, Reply, Shared};
use crate::error::{invalid, Error, Result};
use crate::state::{BranchId, BranchState};
use crate::sync::lock;

impl Context {
    /// Split a caller's batch into items that can run (marked busy) and
    /// per-item errors for the rest (stale, busy, repeated, or a bad
    /// input), so one bad item never sinks the others. The group to run,
    /// whose reply gets one result per original item; `None` when nothing
    /// can run (`reply` is answered then).
    fn group(
        &self,
        items: Vec<(BranchId, Input)>,
        all_rows: bool,
        reply: Reply<ItemResults>,
    ) -> Option<Group> {
        if let Err(e) = self.check_open() {
            reply.send(Err(e));
            return None;
        }
        let model = self.model();
        let check = |input: &Input| match input {
            Input::Commit(token) => model.check_token(*token),
            Input::Prefill(tokens) if tokens.is_empty() => {
                Err(invalid("cannot prefill an empty token list"))
            }
            Input::Prefill(tokens) => model.check_tokens(tokens),
        };
        let mut early: Vec<Option<Error>> = Vec::with_capacity(items.len());
        let mut runnable = Vec::with_capacity(items.len());
        {
            let mut branches = lock(&self.shared.branches);
            let mut seen: Vec<BranchId> = Vec::with_capacity(items.len());
            for (id, input) in items {
                let verdict = check(&input).and_then(|()| {
                    if seen.contains(&id) || branches.get(id)?.is_busy() {
                        return Err(Error::BranchBusy);
                    }
                    Ok(())
                });
                seen.push(id);
                match verdict {
                    Ok(()) => {
                        if let Ok(b) = branches.get_mut(id) {
                            b.busy = true;
                        }
                        runnable.push((id, input));
                        early.push(None);
                    }
                    Err(e) => early.push(Some(e)),
                }
            }
        }
        if runnable.is_empty() {
            reply.send(Ok(early.into_iter().flatten().map(Err).collect()));
            return None;
        }
        let cancel = reply.cancel_flag();
        let mut merge: Reply<ItemResults> = Reply::new(move |result: Result<ItemResults>| {
            reply.send(result.map(|ran| {
                let mut ran = ran.into_iter();
                early
                    .into_iter()
                    .map(|e| match e {
                        Some(e) => Err(e),
                        None => ran.next().unwrap_or(Ok(())),
                    })
                    .collect()
            }))
        });
        if let Some(flag) = cancel {
            merge = merge.cancel_with(flag);
        }
        Some(Group::new(runnable, all_rows, merge))
    }

    /// Decode the groups of one step together (see [`crate::engine`]'s
    /// `step` module): each group is one caller's batch of commits
    /// ([`StepInput::Commit`]: accept the token, then decode it) and
    /// prefills ([`StepInput::Prefill`]), all or nothing on its own; groups
    /// do not fail each other. `all_rows` keeps every position's logits of
    /// a group's prefills (see [`Branch::take_rows`](crate::Branch::take_rows)). Each group's
    /// reply gets one result per item. The worker runs the step with the
    /// steps queued next to it, one decode per round: every commit, then
    /// prompt tokens up to `n_batch` (a long prompt spans rounds, and
    /// commits arriving meanwhile join the next one).
    ///
    /// [`StepInput::Commit`]: crate::StepInput::Commit
    /// [`StepInput::Prefill`]: crate::StepInput::Prefill
    pub fn branch_step(&self, groups: Vec<StepGroup>) {
        let groups: Vec<Group> = groups
            .into_iter()
            .filter_map(|(items, all_rows, reply)| self.group(items, all_rows, reply))
            .collect();
        if !groups.is_empty() {
            self.submit(Job::Step(Step::new(groups)));
        }
    }

    /// Accept one token per branch and decode them all together: a step
    /// of one group, all or nothing on a full KV cache.
    pub fn branch_commit(&self, items: Vec<(BranchId, i32)>, reply: Reply<ItemResults>) {
        let items = items
            .into_iter()
            .map(|(id, t)| (id, Input::Commit(t)))
            .collect();
        self.branch_step(vec![(items, false, reply)]);
    }

    /// Decode a token list into each branch, packed into as few
    /// `llama_decode` calls as `n_batch` allows: a step of one group. With
    /// `all_rows`, every position's logits are kept for
    /// [`Branch::take_rows`](crate::Branch::take_rows) (one decode verifies a whole draft),
    /// not only the last token's.
    pub fn branch_prefill(
        &self,
        items: Vec<(BranchId, Vec<i32>)>,
        all_rows: bool,
        reply: Reply<ItemResults>,
    ) {
        let items = items
            .into_iter()
            .map(|(id, t)| (id, Input::Prefill(t)))
            .collect();
        self.branch_step(vec![(items, all_rows, reply)]);
    }

    /// [`Branch::produce`](crate::Branch::produce) for many branches in one call, one
    /// result per branch in order (a branch that fails -- gone, busy, a
    /// grammar that cannot continue -- fails alone). Cheap samplers run
    /// here, under the branches lock; the slow ones
    /// ([`Branch::produce_is_slow`](crate::Branch::produce_is_slow): grammar masks, whole-vocabulary
    /// sorts) are detached and sampled outside it, spread over up to
    /// `available_parallelism` threads, and `reply` is answered from there
    /// once every token is chosen. Without a slow one, `reply` is answered
    /// before this returns.
    pub fn branch_produce_many(&self, ids: Vec<BranchId>, reply: Reply<Vec<Result<i32>>>) {
        if let Err(e) = self.check_open() {
            return reply.send(Err(e));
        }
        let mut results: Vec<Result<i32>> = Vec::with_capacity(ids.len());
        let mut slow: Vec<(usize, BranchId, BranchState)> = Vec::new();
        {
            let mut branches = lock(&self.shared.branches);
            for (i, &id) in ids.iter().enumerate() {
                let result = branches.get_mut(id).and_then(|b| {
                    if b.is_busy() || ids[..i].contains(&id) {
                        return Err(Error::BranchBusy);
                    }
                    if b.produce_is_slow() {
                        b.busy = true;
                        slow.push((i, id, b.detach_for_produce()));
                        return Ok(-1); // answered by the sampler threads
                    }
                    b.produce()
                });
                results.push(result);
            }
        }
        if slow.is_empty() {
            return reply.send(Ok(results));
        }
        let shared = Arc::clone(&self.shared);
        // Reachable here until the thread has taken it, so that a thread
        // that cannot start still gives the branches back and answers.
        let slot = Arc::new(Mutex::new(Some((slow, results, reply))));
        let taken = Arc::clone(&slot);
        fn finish(
            shared: &Shared,
            slow: Vec<(usize, BranchId, BranchState)>,
            chosen: Vec<Result<i32>>,
            mut results: Vec<Result<i32>>,
        ) -> Vec<Result<i32>> {
            let mut branches = lock(&shared.branches);
            for ((i, id, detached), token) in slow.into_iter().zip(chosen) {
                if let Ok(state) = branches.get_mut(id) {
                    state.reattach(detached);
                    state.busy = false;
                }
                results[i] = token;
            }
            results
        }
        let spawned = std::thread::Builder::new()
            .name("lloyal-sampler".into())
            .spawn(move || {
                let Some((mut slow, results, reply)) = lock(&taken).take() else {
                    return;
                };
                let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
                let per = slow.len().div_ceil(threads.min(slow.len()));
                let mut chosen: Vec<Result<i32>> = Vec::with_capacity(slow.len());
                std::thread::scope(|scope| {
                    let handles: Vec<_> = slow
                        .chunks_mut(per)
                        .map(|chunk| {
                            scope.spawn(move || {
                                chunk
                                    .iter_mut()
                                    .map(|(_, _, detached)| {
                                        catch_unwind(AssertUnwindSafe(|| detached.produce()))
                                            .unwrap_or_else(|p| Err(Error::from_panic(p)))
                                    })
                                    .collect::<Vec<_>>()
                            })
                        })
                        .collect();
                    for h in handles {
                        match h.join() {
                            Ok(tokens) => chosen.extend(tokens),
                            // (`produce` runs under catch_unwind: this is
                            // the thread itself failing; its chunk's slots
                            // are filled below.)
                            Err(p) => {
                                let e = Error::from_panic(p);
                                chosen.extend((0..per).map(|_| Err(e.clone())));
                            }
                        }
                    }
                });
                chosen.truncate(slow.len());
                reply.send(Ok(finish(&shared, slow, chosen, results)));
            });
        if let Err(e) = spawned {
            if let Some((slow, results, reply)) = lock(&slot).take() {
                let failed = (0..slow.len())
                    .map(|_| {
                        Err(Error::Internal(format!(
                            "could not start a sampler thread: {e}"
                        )))
                    })
                    .collect();
                reply.send(Ok(finish(&self.shared, slow, failed, results)));
            }
        }
    }
}
