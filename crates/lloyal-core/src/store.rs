//! Branch operations: the `Context` methods that start them and the worker
//! code that runs them. This is where continuous tree batching happens:
//! tokens of many branches -- different sequences, different positions,
//! each needing its own logits -- share one `llama_decode`.
//!
//! Cheap, decode-free operations (create, produce, accept, reading state)
//! run on the caller's thread under the `branches` lock. Anything touching
//! the KV cache is a [`BranchJob`] on the worker. A branch is marked busy
//! from submission until its job finishes, so a second operation on it in
//! the meantime fails with `BranchBusy` instead of interleaving.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use llama_cpp_2::token::LlamaToken;

use crate::branch::{BranchId, BranchState, Branches};
use crate::context::{lock, Context, Job, Reply, Worker};
use crate::error::{invalid, Error, Result};
use crate::grammar::Grammar;
use crate::metrics::{LogitStats, SUPER_BLOCK};
use crate::sampling::{Sampler, SamplingParams};

/// Logits (all rows of a batch) up to which the log-sum-exps are summed in
/// the background after the reply; above, with the copy, before it. Small
/// batches stay in the CPU cache, so summing them later reads them again
/// cheaply, off the caller's path; large ones (Gemma 3 at 8 or 16 branches:
/// 8-16 MiB) would come from memory a second time, which cost more than
/// it saved (measured on the 2-core machine: no gain at 4 x 262k logits,
/// 0.2 ms more per step at 16 x 262k).
const BACKGROUND_SUMS_UP_TO: usize = 1 << 20;

/// Each `SUPER_BLOCK` piece's greedy winner (an index into the piece), for
/// one row, piece by piece.
type PieceWinners = Vec<Option<i32>>;

/// Copy each row of `sources` into `targets` and find its greedy winner,
/// spread over `threads` OpenMP threads; see `Worker::rows_logits`. The
/// unit of work is a `SUPER_BLOCK` piece of a row: copied and scanned for
/// its greedy winner while it is in the cache (one read of each row from
/// memory), and `with_sums` also summed for the log-sum-exp. Returns each
/// row's stats (the argmax only `with_argmax`; the log-sum-exp filled in
/// `with_sums`, else to come) and each piece's winner, row by row, piece by
/// piece, for [`log_sum_exps`].
fn copy_and_scan(
    sources: &[&[f32]],
    targets: Vec<&mut [f32]>,
    with_argmax: &[bool],
    with_sums: bool,
    threads: u32,
) -> (Vec<LogitStats>, Vec<PieceWinners>) {
    // (row, start) of every piece, rows in order, pieces in order.
    let mut pieces: Vec<(usize, usize)> = Vec::new();
    let mut slots: Vec<Mutex<&mut [f32]>> = Vec::new();
    for (row, target) in targets.into_iter().enumerate() {
        for (k, slot) in target.chunks_mut(SUPER_BLOCK).enumerate() {
            pieces.push((row, k * SUPER_BLOCK));
            slots.push(Mutex::new(slot));
        }
    }
    type Found = (Option<i32>, Option<(f32, f64)>);
    let found: Vec<Mutex<Found>> = pieces.iter().map(|_| Mutex::new((None, None))).collect();
    crate::omp::for_each(pieces.len(), threads, &|i| {
        let (row, start) = pieces[i];
        let source = &sources[row][start..(start + SUPER_BLOCK).min(sources[row].len())];
        lock(&slots[i]).copy_from_slice(source);
        let winner = crate::sampling::greedy(source);
        let sum = if with_sums {
            crate::metrics::piece_sum(source, winner)
        } else {
            None
        };
        *lock(&found[i]) = (winner, sum);
    });
    let mut winners: Vec<PieceWinners> = vec![Vec::new(); sources.len()];
    let mut sums: Vec<Vec<Option<(f32, f64)>>> = vec![Vec::new(); sources.len()];
    for ((row, _), f) in pieces.iter().zip(found) {
        let (winner, sum) = f.into_inner().unwrap_or_else(|p| p.into_inner());
        winners[*row].push(winner);
        sums[*row].push(sum);
    }
    let stats = winners
        .iter()
        .enumerate()
        .map(|(row, w)| {
            // The largest winner, the earliest on ties (= greedy's choice).
            let best = w
                .iter()
                .enumerate()
                .filter_map(|(k, j)| {
                    j.map(|j| {
                        (
                            sources[row][k * SUPER_BLOCK + j as usize],
                            k * SUPER_BLOCK + j as usize,
                        )
                    })
                })
                .fold(None, |best, (v, i)| match best {
                    Some((bv, _)) if bv >= v => best,
                    _ => Some((v, i)),
                });
            let stats = LogitStats::new(
                best.filter(|_| with_argmax[row])
                    .and_then(|(_, i)| i32::try_from(i).ok()),
            );
            if with_sums {
                stats.fill(crate::metrics::combine_pieces(sums[row].iter().copied()));
            }
            stats
        })
        .collect();
    (stats, winners)
}

/// The work that completes `rows`' stats: the log-sum-exp of each
/// `(snapshot, stats, piece winners)`, one item per `SUPER_BLOCK` piece
/// (`metrics::piece_sum` against the piece's winner); whoever sums a row's
/// last piece combines the row in piece order (`metrics::combine_pieces`,
/// the same bits as `metrics::log_sum_exp`). Items may run on any threads
/// in any order. Returns the item count and the work.
fn log_sum_exps(
    rows: Vec<(Arc<[f32]>, LogitStats, PieceWinners)>,
) -> (usize, Box<dyn Fn(usize) + Send + Sync>) {
    struct Row {
        logits: Arc<[f32]>,
        stats: LogitStats,
        winners: PieceWinners,
        sums: Vec<OnceLock<Option<(f32, f64)>>>,
        left: AtomicUsize,
    }
    let mut items: Vec<(usize, usize)> = Vec::new();
    let rows: Vec<Row> = rows
        .into_iter()
        .enumerate()
        .map(|(r, (logits, stats, winners))| {
            items.extend((0..winners.len()).map(|k| (r, k)));
            Row {
                sums: winners.iter().map(|_| OnceLock::new()).collect(),
                left: AtomicUsize::new(winners.len()),
                logits,
                stats,
                winners,
            }
        })
        .collect();
    for row in rows.iter().filter(|r| r.winners.is_empty()) {
        row.stats.fill(None); // an empty row has no finite logit
    }
    let n = items.len();
    let work = move |i: usize| {
        let (r, k) = items[i];
        let row = &rows[r];
        let start = k * SUPER_BLOCK;
        let piece = &row.logits[start..(start + SUPER_BLOCK).min(row.logits.len())];
        let _ = row.sums[k].set(crate::metrics::piece_sum(piece, row.winners[k]));
        if row.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            row.stats.fill(crate::metrics::combine_pieces(
                row.sums.iter().map(|s| s.get().copied().flatten()),
            ));
        }
    };
    (n, Box::new(work))
}

/// A buffer of `len` floats from `pool` that nobody else holds, or a new one.
fn reuse(pool: &mut Vec<Arc<[f32]>>, len: usize) -> Arc<[f32]> {
    while let Some(mut buf) = pool.pop() {
        if Arc::get_mut(&mut buf).is_some_and(|b| b.len() == len) {
            return buf;
        }
    }
    Arc::from(vec![0f32; len])
}

/// A branch's new logits after a decode: (branch, positions advanced,
/// (snapshot, its stats)).
type Fresh = (BranchId, i32, (Arc<[f32]>, LogitStats));

/// One result per item of a batched operation.
pub type ItemResults = Vec<Result<()>>;

/// What [`Context::branch_prefill_tree`] gives back.
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
fn check_tree(tokens: &[i32], parents: &[i32]) -> Result<()> {
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

/// The jobs to run, in order, each with how many queued jobs it stands
/// for: commits queued back to back (by any callers: tasks, threads, event
/// loops) become one commit, so one decode; each caller still gets its own
/// items' results. (Their branches are distinct: a branch with a commit in
/// flight is busy and refuses another.)
pub(crate) fn merge_commits(jobs: impl Iterator<Item = Job>) -> Vec<(Job, usize)> {
    let mut out: Vec<(Job, usize)> = Vec::new();
    for job in jobs {
        let Job::Branch(BranchJob::Commit { items, reply }) = job else {
            out.push((job, 1));
            continue;
        };
        match out.last_mut() {
            Some((
                Job::Branch(BranchJob::Commit {
                    items: first,
                    reply: r0,
                }),
                n,
            )) => {
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
                *n += 1;
            }
            _ => out.push((Job::Branch(BranchJob::Commit { items, reply }), 1)),
        }
    }
    out
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
fn mark_busy(branches: &mut Branches, ids: &[BranchId]) -> Result<()> {
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

pub(crate) fn clear_busy(branches: &mut Branches, ids: impl IntoIterator<Item = BranchId>) {
    for id in ids {
        if let Ok(b) = branches.get_mut(id) {
            b.busy = false;
        }
    }
}

impl Context {
    /// Create a root branch with its own KV lease (synchronous: no decode).
    pub fn branch_create(&self, params: SamplingParams) -> Result<BranchId> {
        self.check_open()?;
        let mut branches = lock(&self.shared.branches);
        let seq = branches.lease(|s| self.shared.holds_flat_data(s))?;
        let state = match BranchState::new(seq, params) {
            Ok(mut s) => {
                self.model().bind_sampler(s.sampler_mut());
                s
            }
            Err(e) => {
                branches.release(seq);
                return Err(e);
            }
        };
        let id = branches.insert(state);
        drop(branches);
        if self.kv_seq_pos_max(seq).unwrap_or(-1) >= 0 {
            // Queued before any job that could use the branch.
            self.submit(Job::Branch(BranchJob::ClearSeq { seq }));
        }
        Ok(id)
    }

    /// Read or change a branch under the lock (not while it is busy).
    pub fn with_branch<T>(
        &self,
        id: BranchId,
        f: impl FnOnce(&mut BranchState) -> Result<T>,
    ) -> Result<T> {
        self.check_open()?;
        let mut branches = lock(&self.shared.branches);
        let state = branches.get_mut(id)?;
        if state.busy {
            return Err(Error::BranchBusy);
        }
        f(state)
    }

    /// Read a branch's state even while an operation is in flight.
    pub fn read_branch<T>(&self, id: BranchId, f: impl FnOnce(&BranchState) -> T) -> Result<T> {
        self.check_open()?;
        let branches = lock(&self.shared.branches);
        Ok(f(branches.get(id)?))
    }

    /// Leases free now.
    pub fn leases_available(&self) -> usize {
        let branches = lock(&self.shared.branches);
        branches
            .free_seqs()
            .filter(|&s| !self.shared.holds_flat_data(s))
            .count()
    }

    /// Replace the branch's sampling parameters. Returns whether anything
    /// changed; an unchanged call keeps the sampler as it is. A change keeps
    /// the penalty history; the random stream restarts only if the seed
    /// changed.
    pub fn branch_set_params(&self, id: BranchId, params: SamplingParams) -> Result<bool> {
        self.with_branch(id, |b| {
            if *b.sampler().params() == params {
                return Ok(false);
            }
            b.sampler_mut().set_params(params)?;
            self.model().bind_sampler(b.sampler_mut());
            Ok(true)
        })
    }

    /// Restart the branch's random stream from `seed`.
    pub fn branch_reseed(&self, id: BranchId, seed: u64) -> Result<()> {
        self.with_branch(id, |b| {
            b.sampler_mut().reseed(seed);
            Ok(())
        })
    }

    pub fn branch_set_logits(&self, id: BranchId, logits: &[f32]) -> Result<()> {
        self.check_logits_len(logits)?;
        self.with_branch(id, |b| {
            b.set_logits(Arc::from(logits));
            Ok(())
        })
    }

    fn check_biases(&self, biases: &[(i32, f32)]) -> Result<()> {
        for &(t, b) in biases {
            self.model().check_token(t)?;
            if b.is_nan() {
                return Err(invalid(format!("bias for token {t} is NaN")));
            }
        }
        Ok(())
    }

    pub fn branch_set_logit_bias(&self, id: BranchId, biases: Vec<(i32, f32)>) -> Result<()> {
        self.check_biases(&biases)?;
        self.with_branch(id, |b| {
            b.logit_bias = Arc::new(biases);
            Ok(())
        })
    }

    pub fn branch_steer(&self, id: BranchId, biases: Vec<(i32, f32)>) -> Result<()> {
        self.check_biases(&biases)?;
        self.with_branch(id, |b| {
            b.steer = biases;
            Ok(())
        })
    }

    /// Whether [`Context::branch_produce`] is slow for this branch (see
    /// `BranchState::produce_is_slow`): callers on an event loop run it on
    /// another thread then.
    pub fn branch_produce_is_slow(&self, id: BranchId) -> Result<bool> {
        self.read_branch(id, BranchState::produce_is_slow)
    }

    /// Sample the branch's next token; nothing is written.
    pub fn branch_produce(&self, id: BranchId) -> Result<i32> {
        self.with_branch(id, BranchState::produce)
    }

    /// Accept a token without decoding it (penalties and metrics).
    /// Replace (or remove) a branch's grammar. Compile it first with
    /// [`crate::Grammar::new`] on this context's model.
    pub fn branch_set_grammar(&self, id: BranchId, grammar: Option<Grammar>) -> Result<()> {
        self.with_branch(id, |b| {
            b.set_grammar(grammar);
            Ok(())
        })
    }

    pub fn branch_accept(&self, id: BranchId, token: i32) -> Result<()> {
        self.model().check_token(token)?;
        self.with_branch(id, |b| b.accept(token))
    }

    fn submit_for(&self, ids: &[BranchId], job: BranchJob) {
        let marked = self
            .check_open()
            .and_then(|()| mark_busy(&mut lock(&self.shared.branches), ids));
        match marked {
            Ok(()) => self.submit(Job::Branch(job)),
            Err(e) => job.fail(e),
        }
    }

    /// Fork: a new branch sharing `parent`'s KV prefix (no tensor copy under
    /// unified KV) with a clone of its sampler, logits, metrics and bias.
    pub fn branch_fork(&self, parent: BranchId, reply: Reply<BranchId>) {
        self.submit_for(&[parent], BranchJob::Fork { parent, reply });
    }

    /// [`Context::branch_fork`] on the calling thread, when the worker is
    /// idle; `None` when it is busy (then call `branch_fork`). Same result,
    /// without the two thread hand-offs.
    pub fn branch_fork_now(&self, parent: BranchId) -> Option<Result<BranchId>> {
        self.run_inline(|w| {
            if lock(&w.shared.branches).get(parent)?.busy {
                return Err(Error::BranchBusy);
            }
            w.fork(parent)
        })
    }

    /// BlinkKV for a branch: clear its KV and decode `sinks + tail` at
    /// positions from 0. Sampler (penalty history, random stream), grammar,
    /// metrics and children are untouched; the logits become the tail's.
    pub fn branch_clear_and_reseed(
        &self,
        id: BranchId,
        sinks: Vec<i32>,
        tail: Vec<i32>,
        reply: Reply<()>,
    ) {
        let mut tokens = sinks;
        tokens.extend(tail);
        if tokens.is_empty() {
            return reply.send(Err(invalid("sinks and tail are both empty")));
        }
        if let Err(e) = self.model().check_tokens(&tokens) {
            return reply.send(Err(e));
        }
        if tokens.len() > self.n_ctx() as usize {
            return reply.send(Err(invalid(format!(
                "sinks + tail hold {} tokens; the context holds n_ctx={}",
                tokens.len(),
                self.n_ctx()
            ))));
        }
        self.submit_for(&[id], BranchJob::Reseed { id, tokens, reply });
    }

    /// Drop the branch's KV from `position` on (`0 <= position <= its
    /// position`), so it continues from there: a rejected speculative draft,
    /// a backtrack. The logits snapshot becomes `logits` (the distribution
    /// after the last kept token, e.g. a row of `prefill(all_rows)`), or is
    /// cleared. Sampler history, metrics and grammar are not rewound.
    pub fn branch_truncate(
        &self,
        id: BranchId,
        position: i32,
        logits: Option<Vec<f32>>,
        reply: Reply<()>,
    ) {
        let checked = self.read_branch(id, |b| b.position).and_then(|current| {
            if !(0..=current).contains(&position) {
                return Err(invalid(format!(
                    "position must be in [0, {current}] (the branch's position), got {position}"
                )));
            }
            match &logits {
                Some(l) => self.check_logits_len(l),
                None => Ok(()),
            }
        });
        match checked {
            Ok(()) => self.submit_for(
                &[id],
                BranchJob::Truncate {
                    id,
                    position,
                    logits,
                    reply,
                },
            ),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// Prune a branch (`cascade`: with its whole subtree), freeing leases.
    /// A prune queues behind operations already in flight on the branch
    /// (the worker runs jobs in order) instead of failing with `BranchBusy`,
    /// so cleanup after a cancelled commit never leaks the lease.
    pub fn branch_prune(&self, id: BranchId, cascade: bool, reply: Reply<()>) {
        let checked = self
            .check_open()
            .and_then(|()| lock(&self.shared.branches).get(id).map(|_| ()));
        match checked {
            Ok(()) => self.submit(Job::Branch(BranchJob::Prune { id, cascade, reply })),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// Free a branch its owner dropped without pruning (a Python `Branch`
    /// garbage-collected): its lease and the cells only it used come back,
    /// and its children become roots (they keep their cells). Queued behind
    /// whatever is in flight; nothing to wait for, and a branch already
    /// gone is no error.
    pub fn branch_drop(&self, id: BranchId) {
        if self.check_open().is_err() {
            return;
        }
        let freed = {
            let mut branches = lock(&self.shared.branches);
            match branches.get(id) {
                Err(_) => return,
                // An operation is in flight: free it after that.
                Ok(b) if b.busy => None,
                Ok(_) => {
                    branches.detach_children(id);
                    let state = branches.remove(id).ok();
                    state.map(|s| {
                        branches.release(s.seq);
                        s.seq
                    })
                }
            }
        };
        match freed {
            // The lease is free now, so a branch created next can take it:
            // its cells are cleared by a job queued ahead of anything that
            // new branch does (the mirror says so already).
            Some(seq) => {
                self.shared.forget_seq(seq);
                self.submit(Job::Branch(BranchJob::ClearSeq { seq }));
            }
            None => self.submit(Job::Branch(BranchJob::Drop { id })),
        }
    }

    /// [`Context::branch_prune`] on the calling thread, when the worker is
    /// idle; `None` when it is busy (then call `branch_prune`).
    pub fn branch_prune_now(&self, id: BranchId, cascade: bool) -> Option<Result<()>> {
        self.run_inline(|w| w.prune(id, cascade))
    }

    /// Split a batch into items that can run (marked busy) and per-item
    /// errors for the rest (stale, busy, repeated, or failing `check`), so
    /// one bad item never sinks the others. `reply` gets one result per
    /// original item.
    fn submit_items<T: Send + 'static>(
        &self,
        items: Vec<(BranchId, T)>,
        check: impl Fn(&T) -> Result<()>,
        reply: Reply<ItemResults>,
        job: impl FnOnce(Vec<(BranchId, T)>, Reply<ItemResults>) -> BranchJob,
    ) {
        if let Err(e) = self.check_open() {
            return reply.send(Err(e));
        }
        let mut early: Vec<Option<Error>> = Vec::with_capacity(items.len());
        let mut runnable = Vec::with_capacity(items.len());
        {
            let mut branches = lock(&self.shared.branches);
            let mut seen: Vec<BranchId> = Vec::with_capacity(items.len());
            for (id, payload) in items {
                let verdict = check(&payload).and_then(|()| {
                    if seen.contains(&id) || branches.get(id)?.busy {
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
                        runnable.push((id, payload));
                        early.push(None);
                    }
                    Err(e) => early.push(Some(e)),
                }
            }
        }
        if runnable.is_empty() {
            return reply.send(Ok(early.into_iter().flatten().map(Err).collect()));
        }
        let merge: Reply<ItemResults> = Reply::new(move |result: Result<ItemResults>| {
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
        self.submit(Job::Branch(job(runnable, merge)));
    }

    /// Accept one token per branch and decode them all together.
    pub fn branch_commit(&self, items: Vec<(BranchId, i32)>, reply: Reply<ItemResults>) {
        let model = Arc::clone(self.model());
        self.submit_items(
            items,
            move |&t| model.check_token(t),
            reply,
            |items, reply| BranchJob::Commit { items, reply },
        );
    }

    /// Decode a token list into each branch, packed into as few
    /// `llama_decode` calls as `n_batch` allows. With `all_rows`, every
    /// position's logits are kept for [`Context::branch_take_rows`] (one
    /// decode verifies a whole draft), not only the last token's.
    pub fn branch_prefill(
        &self,
        items: Vec<(BranchId, Vec<i32>)>,
        all_rows: bool,
        reply: Reply<ItemResults>,
    ) {
        let model = Arc::clone(self.model());
        self.submit_items(
            items,
            move |tokens: &Vec<i32>| {
                if tokens.is_empty() {
                    return Err(invalid("cannot prefill an empty token list"));
                }
                model.check_tokens(tokens)
            },
            reply,
            move |items, reply| BranchJob::Prefill {
                items,
                all_rows,
                reply,
            },
        );
    }

    /// Decode a token tree into `root` in one pass (tree attention): token
    /// `j` follows `parents[j]` (`-1`: the root's last token), at position
    /// `root.position + depth`. A prefix shared by several leaves is decoded
    /// once, its KV cells shared by their sequences (unified KV). Each leaf
    /// ends as a branch holding its path: the root carries the first leaf,
    /// the others are new independent branches (one lease each, forked from
    /// the root before the decode). Every node's logits come back. On a
    /// failed decode the root is as it was and no branch is created.
    pub fn branch_prefill_tree(
        &self,
        root: BranchId,
        tokens: Vec<i32>,
        parents: Vec<i32>,
        reply: Reply<TreeOutcome>,
    ) {
        let checked =
            check_tree(&tokens, &parents).and_then(|()| self.model().check_tokens(&tokens));
        match checked {
            Ok(()) => self.submit_for(
                &[root],
                BranchJob::PrefillTree {
                    root,
                    tokens,
                    parents,
                    reply,
                },
            ),
            Err(e) => reply.send(Err(e)),
        }
    }

    /// The logits of every position of the branch's last `prefill` with
    /// `all_rows`, row-major (`n * vocab`), taken (a second call gives
    /// `None`).
    pub fn branch_take_rows(&self, id: BranchId) -> Result<Option<Vec<f32>>> {
        self.check_open()?;
        Ok(lock(&self.shared.branches).get_mut(id)?.rows.take())
    }

    /// Keep `keep`'s KV and prune every other branch.
    pub fn branch_retain_only(&self, keep: BranchId, reply: Reply<()>) {
        self.submit_for(&[keep], BranchJob::RetainOnly { keep, reply });
    }

    /// Snapshot a branch: its KV cells, logits and position, framed like
    /// `kv_cache_save` (model fingerprint + CRC). Sampler state is not
    /// included: a restored branch gets the parameters you give it.
    pub fn branch_save(&self, id: BranchId, reply: Reply<Vec<u8>>) {
        self.submit_for(&[id], BranchJob::Save { id, reply });
    }

    /// A new root branch (own lease) from a [`Context::branch_save`] snapshot.
    pub fn branch_restore(&self, data: Vec<u8>, params: SamplingParams, reply: Reply<BranchId>) {
        match self.check_open().and_then(|()| params.validate()) {
            Ok(()) => self.submit(Job::Branch(BranchJob::Restore {
                data,
                params,
                reply,
            })),
            Err(e) => reply.send(Err(e)),
        }
    }
}

/// Branch snapshot payload: `[u64 n_logits][f32 logits...][llama bytes]`.
fn pack_branch(logits: Option<&[f32]>, llama: &[u8]) -> Vec<u8> {
    let logits = logits.unwrap_or(&[]);
    let mut out = Vec::with_capacity(8 + logits.len() * 4 + llama.len());
    out.extend_from_slice(&(logits.len() as u64).to_le_bytes());
    for l in logits {
        out.extend_from_slice(&l.to_le_bytes());
    }
    out.extend_from_slice(llama);
    out
}

fn unpack_branch(payload: &[u8], vocab: usize) -> Result<(Option<Vec<f32>>, &[u8])> {
    let bad = || Error::State("the branch snapshot is malformed".into());
    let n = payload
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(bad)?;
    if n != 0 && n != vocab {
        return Err(bad());
    }
    let end = 8 + n * 4;
    let body = payload.get(8..end).ok_or_else(bad)?;
    let logits = (n > 0).then(|| {
        body.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    });
    Ok((logits, &payload[end..]))
}

/// What a commit may have to undo.
struct Undo {
    id: BranchId,
    seq: i32,
    position: i32,
    sampler: Sampler,
    perplexity: crate::metrics::PerplexityTracker,
    sampling_perplexity: crate::metrics::PerplexityTracker,
    /// Tokens the branch's grammar had consumed before the commit.
    grammar_consumed: Option<usize>,
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
                let shared = Arc::clone(&self.shared);
                let mut branches = lock(&shared.branches);
                branches.detach_children(id);
                let _ = self.dispose(&mut branches, id);
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

    fn refresh_seq(&self, seq: i32) {
        if let Ok(slot) = usize::try_from(seq) {
            self.refresh_pos(slot, seq);
        }
    }

    fn fork(&mut self, parent: BranchId) -> Result<BranchId> {
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
    fn dispose(&mut self, branches: &mut Branches, id: BranchId) -> Result<()> {
        let state = branches.remove(id)?;
        let _ = self.remove_cells(state.seq, None, None);
        branches.release(state.seq);
        self.refresh_seq(state.seq);
        Ok(())
    }

    fn prune(&mut self, id: BranchId, cascade: bool) -> Result<()> {
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

    fn retain_only(&mut self, keep: BranchId) -> Result<()> {
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

    fn save_branch(&mut self, id: BranchId) -> Result<Vec<u8>> {
        let (seq, logits) = {
            let branches = lock(&self.shared.branches);
            let b = branches.get(id)?;
            (b.seq, b.logits.clone())
        };
        let llama = crate::kv::read_seq(&self.ctx, seq)?;
        let fp = crate::kv::fingerprint(&self.model, &self.params);
        Ok(crate::kv::encode(
            fp,
            &[],
            &pack_branch(logits.as_deref(), &llama),
        ))
    }

    fn restore_branch(&mut self, data: &[u8], params: SamplingParams) -> Result<BranchId> {
        let fp = crate::kv::fingerprint(&self.model, &self.params);
        let (_, payload) = crate::kv::decode(fp, data)?;
        let (logits, llama) = unpack_branch(payload, self.model.vocab_size() as usize)?;
        let mut state = BranchState::new(0, params)?;
        self.model.bind_sampler(state.sampler_mut());
        let llama = crate::kv::check_payload(llama, self.ctx.n_ctx())?;
        let seq = lock(&self.shared.branches).lease(|s| self.shared.holds_flat_data(s))?;
        if let Err(e) = crate::kv::write_seq(&mut self.ctx, seq, llama) {
            lock(&self.shared.branches).release(seq);
            self.refresh_seq(seq);
            return Err(e);
        }
        self.refresh_seq(seq);
        state.seq = seq;
        state.position = self.ctx.kv_cache_seq_pos_max(seq) + 1;
        if let Some(l) = logits {
            state.set_logits(Arc::from(l));
        }
        Ok(lock(&self.shared.branches).insert(state))
    }

    /// Empty the branch's sequence, then prefill `tokens` from position 0.
    /// If that decode fails the branch is left empty (position 0, no
    /// logits) and the error says why; nothing else changes.
    fn reseed(&mut self, id: BranchId, tokens: Vec<i32>) -> Result<()> {
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

    fn truncate(&mut self, id: BranchId, position: i32, logits: Option<Vec<f32>>) -> Result<()> {
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

    fn shared_pos_len(&self) -> i32 {
        lock(&self.shared.branches).n_seq_max() as i32
    }

    /// Put the KV cache and the branches back as they were before a failed
    /// batch. KV first (no lock held), then the Rust-side state.
    fn undo(&mut self, undo: Vec<Undo>) {
        for u in &undo {
            let _ = self.remove_cells(u.seq, u32::try_from(u.position).ok(), None);
            self.refresh_seq(u.seq);
        }
        let shared = Arc::clone(&self.shared);
        let mut branches = lock(&shared.branches);
        for u in undo {
            if let Ok(b) = branches.get_mut(u.id) {
                b.position = u.position;
                *b.sampler_mut() = u.sampler;
                b.perplexity = u.perplexity;
                b.sampling_perplexity = u.sampling_perplexity;
                if let (Some(count), Some(g)) = (u.grammar_consumed, b.grammar.as_mut()) {
                    let _ = g.rewind(count);
                }
            }
        }
    }

    /// Store each item's fresh logits and advance its position.
    fn apply(&mut self, fresh: Vec<Fresh>) {
        let shared = Arc::clone(&self.shared);
        let mut branches = lock(&shared.branches);
        for (id, advance, (logits, stats)) in fresh {
            if let Ok(b) = branches.get_mut(id) {
                b.position += advance;
                if let Some(old) = b.replace_logits_with(logits, Some(stats)) {
                    self.recycle(old);
                }
            }
        }
    }

    /// Keep a replaced snapshot for reuse if nobody else holds it (forks
    /// share snapshots until they decode).
    fn recycle(&mut self, old: Arc<[f32]>) {
        if Arc::strong_count(&old) == 1 && self.logit_pool.len() < 256 {
            self.logit_pool.push(old);
        }
    }

    /// Copies of batch rows' logits `(row, with_argmax)`, in recycled
    /// buffers when free (a vocabulary-sized allocation per branch per step
    /// otherwise), each with its stats. Rows are cut into `SUPER_BLOCK`
    /// pieces and the work spread over llama.cpp's OpenMP threads, idle
    /// between decodes (`omp.rs`), in two passes:
    /// - now: copy each piece and find its greedy winner while it is in the
    ///   CPU cache (the argmax is what a greedy `produce` needs next);
    /// - in the background: each piece's exponential sum, for the
    ///   log-sum-exp that the next `accept` needs. The team's other threads
    ///   start on it at once, while the worker replies and the caller
    ///   picks its next tokens; the worker joins in before its next job
    ///   (`Worker::finish_background`). A reader that comes first computes
    ///   the value itself (the same bits). Batches of more than
    ///   `BACKGROUND_SUMS_UP_TO` logits are summed in the first pass
    ///   instead, while each piece is in the cache.
    fn rows_logits(&mut self, rows: &[(i32, bool)]) -> Vec<(Arc<[f32]>, LogitStats)> {
        self.finish_background();
        let threads = self.params.effective_threads();
        let pool = &mut self.logit_pool;
        let sources: Vec<&[f32]> = rows
            .iter()
            .map(|&(r, _)| self.ctx.get_logits_ith(r))
            .collect();
        let mut buffers: Vec<Arc<[f32]>> = sources.iter().map(|s| reuse(pool, s.len())).collect();
        let targets: Vec<&mut [f32]> = buffers
            .iter_mut()
            .map(|b| Arc::get_mut(b).expect("a fresh or unshared buffer"))
            .collect();
        let greedy: Vec<bool> = rows.iter().map(|r| r.1).collect();
        let total: usize = sources.iter().map(|s| s.len()).sum();
        let now = total > BACKGROUND_SUMS_UP_TO;
        let (stats, winners) = copy_and_scan(&sources, targets, &greedy, now, threads);
        if now {
            self.keep_team_awake();
            return buffers.into_iter().zip(stats).collect();
        }
        let (n, work) = log_sum_exps(
            buffers
                .iter()
                .zip(&stats)
                .zip(winners)
                .map(|((b, s), w)| (Arc::clone(b), s.clone(), w))
                .collect(),
        );
        self.background = Some(crate::omp::Background::start(n, threads, work));
        buffers.into_iter().zip(stats).collect()
    }

    /// Decode the current batch; on failure undo everything in `undo`.
    fn decode_or_undo(&mut self, undo: &mut Option<Vec<Undo>>) -> Result<()> {
        let n = self.batch.n_tokens() as usize;
        self.llama_decode(n).inspect_err(|_| {
            if let Some(u) = undo.take() {
                self.undo(u);
            }
        })
    }

    /// Commit `items` in one decode; when the KV cache cannot take them
    /// all, every branch is as before and the halves are tried on their
    /// own, so the commits that fit succeed and only the rest fail (each
    /// with `KvCacheFull`): commits merged from several callers do not
    /// fail each other.
    fn commit(&mut self, items: &[(BranchId, i32)]) -> Result<ItemResults> {
        match self.commit_once(items) {
            Err(Error::KvCacheFull(_)) if items.len() > 1 => {
                let (a, b) = items.split_at(items.len() / 2);
                let mut results = self.commit_split(a)?;
                results.extend(self.commit_split(b)?);
                Ok(results)
            }
            other => other,
        }
    }

    fn commit_split(&mut self, items: &[(BranchId, i32)]) -> Result<ItemResults> {
        match self.commit(items) {
            Err(e @ Error::KvCacheFull(_)) => Ok(vec![Err(e)]),
            other => other,
        }
    }

    fn commit_once(&mut self, items: &[(BranchId, i32)]) -> Result<ItemResults> {
        // Accept under the lock (the branches are busy: nobody else touches
        // them), decode without it, then store the results under it again.
        let mut undo = Vec::with_capacity(items.len());
        let mut results: ItemResults = Vec::with_capacity(items.len());
        // (id, seq, pos, token, greedy)
        let mut live: Vec<(BranchId, i32, i32, i32, bool)> = Vec::new();
        {
            let mut branches = lock(&self.shared.branches);
            for &(id, token) in items {
                let accepted = branches.get_mut(id).and_then(|b| {
                    let saved = Undo::of(id, b);
                    b.accept(token)?;
                    Ok((saved, b.seq, b.position, b.produces_argmax()))
                });
                match accepted {
                    Ok((saved, seq, pos, greedy)) => {
                        undo.push(saved);
                        live.push((id, seq, pos, token, greedy));
                        results.push(Ok(()));
                    }
                    Err(e) => results.push(Err(e)),
                }
            }
        }
        let mut undo = Some(undo);
        let mut fresh = Vec::with_capacity(live.len());
        for chunk in live.chunks(self.n_batch) {
            self.batch.clear();
            for &(_, seq, pos, token, _) in chunk {
                self.batch
                    .add(LlamaToken(token), pos, &[seq], true)
                    .map_err(|e| Error::Internal(format!("batch add: {e}")))?;
            }
            self.decode_or_undo(&mut undo)?;
            let rows: Vec<(i32, bool)> = (0..chunk.len() as i32)
                .zip(chunk.iter().map(|c| c.4))
                .collect();
            let logits = self.rows_logits(&rows);
            fresh.extend(chunk.iter().zip(logits).map(|(c, l)| (c.0, 1, l)));
        }
        for &(_, seq, ..) in &live {
            self.refresh_seq(seq);
        }
        self.apply(fresh);
        Ok(results)
    }

    fn prefill(&mut self, items: &[(BranchId, Vec<i32>)], all_rows: bool) -> Result<ItemResults> {
        let mut undo = Vec::new();
        let mut results: ItemResults = Vec::with_capacity(items.len());
        // (id, seq, start position, tokens, greedy)
        let mut work: Vec<(BranchId, i32, i32, &[i32], bool)> = Vec::new();
        {
            let branches = lock(&self.shared.branches);
            for (id, tokens) in items {
                match branches.get(*id) {
                    Ok(b) => {
                        undo.push(Undo::of(*id, b));
                        work.push((*id, b.seq, b.position, tokens, b.produces_argmax()));
                        results.push(Ok(()));
                    }
                    Err(e) => results.push(Err(e)),
                }
            }
        }
        // Greedy bin packing: fill each batch to n_batch, splitting items
        // across batches where needed; logits for each item's last token
        // (every token's with `all_rows`).
        let mut undo = Some(undo);
        let mut fresh = Vec::with_capacity(work.len());
        // (id, advance, row, greedy)
        let mut rows: Vec<(BranchId, i32, i32, bool)> = Vec::new();
        // With `all_rows`: each item's rows so far, and (item, batch row)
        // of the tokens in the current batch.
        let mut all: Vec<Vec<f32>> = Vec::new();
        if all_rows {
            let vocab = self.model.vocab_size() as usize;
            all = work
                .iter()
                .map(|w| Vec::with_capacity(w.3.len() * vocab))
                .collect();
        }
        let mut batch_rows: Vec<(usize, i32)> = Vec::new();
        let total: usize = work.iter().map(|w| w.3.len()).sum();
        let mut added = 0usize;
        self.batch.clear();
        for (item, &(id, seq, start, tokens, greedy)) in work.iter().enumerate() {
            for (j, &t) in tokens.iter().enumerate() {
                let last = j + 1 == tokens.len();
                if last {
                    rows.push((id, tokens.len() as i32, self.batch.n_tokens(), greedy));
                }
                if all_rows {
                    batch_rows.push((item, self.batch.n_tokens()));
                }
                self.batch
                    .add(LlamaToken(t), start + j as i32, &[seq], last || all_rows)
                    .map_err(|e| Error::Internal(format!("batch add: {e}")))?;
                added += 1;
                if self.batch.n_tokens() as usize == self.n_batch || added == total {
                    self.decode_or_undo(&mut undo)?;
                    for (item, row) in batch_rows.drain(..) {
                        all[item].extend_from_slice(self.ctx.get_logits_ith(row));
                    }
                    let wanted: Vec<(i32, bool)> = rows.iter().map(|r| (r.2, r.3)).collect();
                    let logits = self.rows_logits(&wanted);
                    fresh.extend(rows.drain(..).zip(logits).map(|(r, l)| (r.0, r.1, l)));
                    self.batch.clear();
                }
            }
        }
        for &(_, seq, ..) in &work {
            self.refresh_seq(seq);
        }
        self.apply(fresh);
        if all_rows {
            let mut branches = lock(&self.shared.branches);
            for (w, item_rows) in work.iter().zip(all) {
                if let Ok(b) = branches.get_mut(w.0) {
                    b.rows = Some(item_rows);
                }
            }
        }
        Ok(results)
    }
}

impl Worker<'_> {
    fn prefill_tree(
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
    fn drop_tree(&mut self, root: BranchId, base: i32, forks: &[BranchId]) {
        let shared = Arc::clone(&self.shared);
        let mut branches = lock(&shared.branches);
        for &id in forks {
            let _ = self.dispose(&mut branches, id);
        }
        if let Ok(b) = branches.get_mut(root) {
            b.children.retain(|c| !forks.contains(c));
            let seq = b.seq;
            drop(branches);
            let _ = self.remove_cells(seq, u32::try_from(base).ok(), None);
            self.refresh_seq(seq);
        }
    }
}

impl Undo {
    fn of(id: BranchId, b: &BranchState) -> Self {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 7919) % 1000) as f32 / 37.0 - 10.0)
            .collect()
    }

    #[test]
    fn parallel_copy_and_stats_equal_one_sequential_pass() {
        let mut rows = [row(262_144, 3), row(49_152, 5), row(1000, 7), row(0, 0)];
        rows[1][40_000] = 1e3; // the winner in a later part
        rows[1][10] = 1e3; // ... tied with an earlier one: the earlier wins
        rows[2] = vec![f32::NAN; 1000]; // nothing finite
        for (threads, with_sums) in [1, 2, 4].into_iter().flat_map(|t| [(t, false), (t, true)]) {
            for n in 1..=rows.len() {
                let sources: Vec<&[f32]> = rows[..n].iter().map(Vec::as_slice).collect();
                let mut out: Vec<Vec<f32>> = sources.iter().map(|s| vec![0.0; s.len()]).collect();
                let targets: Vec<&mut [f32]> = out.iter_mut().map(Vec::as_mut_slice).collect();
                let (stats, winners) =
                    copy_and_scan(&sources, targets, &vec![true; n], with_sums, threads);
                if !with_sums {
                    // Nothing cached before the background pass: a reader
                    // would compute the value itself.
                    assert!(stats.iter().all(|s| s.cached_log_sum_exp().is_none()));
                    let (items, work) = log_sum_exps(
                        out.iter()
                            .zip(&stats)
                            .zip(winners)
                            .map(|((o, s), w)| (Arc::from(o.as_slice()), s.clone(), w))
                            .collect(),
                    );
                    crate::omp::Background::start(items, threads, work).finish();
                }
                for (i, s) in sources.iter().enumerate() {
                    assert_eq!(out[i].as_slice().len(), s.len());
                    assert!(out[i]
                        .iter()
                        .zip(*s)
                        .all(|(a, b)| a.to_bits() == b.to_bits()));
                    let reference = LogitStats::of(s, true);
                    let what = format!("row {i}, {threads} threads, sums now: {with_sums}");
                    assert_eq!(stats[i].argmax(), reference.argmax(), "{what}");
                    assert_eq!(
                        stats[i].cached_log_sum_exp().map(|v| v.map(f64::to_bits)),
                        reference.cached_log_sum_exp().map(|v| v.map(f64::to_bits)),
                        "{what}"
                    );
                }
            }
        }
        let (stats, _) =
            copy_and_scan(&[&rows[1]], vec![&mut vec![0.0; 49_152]], &[true], false, 2);
        assert_eq!(stats[0].argmax(), Some(10));
    }

    #[test]
    fn a_reader_before_the_background_pass_gets_the_same_bits() {
        let logits = row(49_152, 11);
        let (stats, winners) =
            copy_and_scan(&[&logits], vec![&mut vec![0.0; 49_152]], &[true], false, 2);
        let early = stats[0].surprisal(&logits, 5, crate::Base::Nats).unwrap();
        let (items, work) = log_sum_exps(vec![(
            Arc::from(logits.as_slice()),
            stats[0].clone(),
            winners[0].clone(),
        )]);
        crate::omp::Background::start(items, 2, work).finish();
        let late = stats[0].surprisal(&logits, 5, crate::Base::Nats).unwrap();
        assert_eq!(early.to_bits(), late.to_bits());
        assert_eq!(
            early.to_bits(),
            crate::metrics::surprisal(&logits, 5, crate::Base::Nats)
                .unwrap()
                .to_bits()
        );
    }
}
