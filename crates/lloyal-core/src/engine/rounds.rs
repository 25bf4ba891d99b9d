//! Steps (see `engine::step`): the tokens of many branches -- commits and
//! prompt chunks of many callers -- in one decode per round, and the undo
//! that leaves every branch of a failed group as it was.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use llama_cpp_2::token::LlamaToken;

use super::scan::{copy_and_scan, log_sum_exps, reuse, BACKGROUND_SUMS_UP_TO};
use super::step::{Group, Input, ItemResults, Progress, Step, Undo, Work};
use super::{Reply, Worker};
use crate::error::{Error, Result};
use crate::metrics::LogitStats;
use crate::state::BranchId;
use crate::sync::lock;

/// The tokens `from..to` of one work item of one group, decoded this round.
#[derive(Clone, Copy)]
struct Part {
    group: usize,
    work: usize,
    from: usize,
    to: usize,
}

/// Rows a batch asked logits for: (part, batch row, greedy) of each part's
/// last token, and (part, batch row) of every token of an `all_rows` group.
#[derive(Default)]
struct Rows {
    last: Vec<(usize, i32, bool)>,
    all: Vec<(usize, i32)>,
}

/// What a round's decodes gave one part, kept until all of them succeed.
#[derive(Default)]
struct Captured {
    fresh: Option<(Arc<[f32]>, LogitStats)>,
    rows: Vec<f32>,
}

impl Worker<'_> {
    pub(crate) fn shared_pos_len(&self) -> i32 {
        lock(&self.shared.branches).n_seq_max() as i32
    }

    /// Put the KV cache and the branches back as they were before a failed
    /// batch. KV first (no lock held), then the Rust-side state.
    pub(crate) fn undo(&mut self, undo: Vec<Undo>) {
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

    /// Keep a replaced snapshot for reuse if nobody else holds it (forks
    /// share snapshots until they decode).
    pub(crate) fn recycle(&mut self, old: Arc<[f32]>) {
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
    pub(crate) fn rows_logits(&mut self, rows: &[(i32, bool)]) -> Vec<(Arc<[f32]>, LogitStats)> {
        self.finish_background();
        let threads = self.threads.now();
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

    /// Run one round of `step`: start the groups that are new (commits are
    /// accepted here, once), decode every commit waiting and as many prompt
    /// tokens as fill the batch, then answer the groups that have finished
    /// and take them out. Returns how many finished.
    pub(crate) fn step_round(&mut self, step: &mut Step) -> usize {
        #[cfg(feature = "testing")]
        self.maybe_panic();
        for g in &mut step.groups {
            if g.progress.is_none() {
                g.progress = Some(self.start_group(g));
            }
            // A caller that gave up: what its group decoded is undone when
            // it finishes (below), as for a group that did not fit.
            if g.reply.cancelled() {
                if let Some(p) = g.progress.as_mut().filter(|p| !p.finished()) {
                    p.failed = Some(Error::Cancelled);
                }
            }
        }
        let mut parts = self.plan(step);
        by_adapters(step, &mut parts, &self.adapters);
        if !parts.is_empty() {
            self.run_parts(step, &parts);
        }
        let mut finished = 0;
        let mut i = 0;
        while i < step.groups.len() {
            if step.groups[i]
                .progress
                .as_ref()
                .is_some_and(Progress::finished)
            {
                let group = step.groups.remove(i);
                self.finish_group(group);
                finished += 1;
            } else {
                i += 1;
            }
        }
        finished
    }

    /// Free the branches of a step whose round panicked (their callers are
    /// answered by the dropped replies).
    pub(crate) fn abandon_step(&mut self, ids: Vec<BranchId>) {
        lock(&self.shared.branches).clear_busy(ids);
    }

    /// Run `group` to the end on its own, now (for jobs that prefill as
    /// one of their steps).
    pub(crate) fn run_group(
        &mut self,
        items: Vec<(BranchId, Input)>,
        all_rows: bool,
    ) -> Result<ItemResults> {
        let (tx, rx) = std::sync::mpsc::channel();
        let reply = Reply::new(move |result| {
            let _ = tx.send(result);
        });
        let mut step = Step::new(vec![Group::new(items, all_rows, reply)]);
        while !step.is_empty() {
            self.step_round(&mut step);
        }
        rx.try_recv()
            .unwrap_or_else(|_| Err(Error::Internal("a step ended unanswered".into())))
    }

    /// Accept a new group's commits and note where each item starts and
    /// what to put back if the group fails. An item whose branch is gone or
    /// refuses its token fails alone, here.
    fn start_group(&mut self, group: &mut Group) -> Progress {
        let items = std::mem::take(&mut group.items);
        let mut progress = Progress {
            results: Vec::with_capacity(items.len()),
            work: Vec::with_capacity(items.len()),
            undo: Vec::with_capacity(items.len()),
            failed: None,
        };
        let mut branches = lock(&self.shared.branches);
        for (id, input) in items {
            let started = branches.get_mut(id).and_then(|b| {
                let saved = Undo::of(id, b);
                let (tokens, commit) = match input {
                    Input::Commit(token) => {
                        b.accept(token)?;
                        (vec![token], true)
                    }
                    Input::Prefill(tokens) => (tokens, false),
                };
                let work = Work {
                    id,
                    seq: b.seq,
                    start: b.position,
                    tokens,
                    decoded: 0,
                    commit,
                    greedy: b.produces_argmax(),
                    fresh: None,
                    rows: Vec::new(),
                    adapters: b.adapters.clone(),
                };
                Ok((saved, work))
            });
            match started {
                Ok((saved, work)) => {
                    progress.undo.push(saved);
                    progress.work.push(work);
                    progress.results.push(Ok(()));
                }
                Err(e) => progress.results.push(Err(e)),
            }
        }
        progress
    }

    /// This round's parts: every commit not decoded yet, then prompt tokens
    /// in arrival order until the last batch is full (at least one batch of
    /// `n_batch` tokens when there is no commit).
    fn plan(&self, step: &Step) -> Vec<Part> {
        let live = || {
            step.groups.iter().enumerate().flat_map(|(g, group)| {
                let progress = group.progress.as_ref().filter(|p| p.failed.is_none());
                progress
                    .into_iter()
                    .flat_map(|p| p.work.iter().enumerate())
                    .map(move |(w, work)| (g, w, work))
            })
        };
        let mut parts: Vec<Part> = live()
            .filter(|(_, _, work)| work.commit && work.decoded == 0)
            .map(|(group, work, _)| Part {
                group,
                work,
                from: 0,
                to: 1,
            })
            .collect();
        let mut room = self.prompt_room(parts.len());
        for (group, w, work) in live() {
            let left = work.tokens.len() - work.decoded;
            if work.commit || left == 0 || room == 0 {
                continue;
            }
            let n = left.min(room);
            room -= n;
            parts.push(Part {
                group,
                work: w,
                from: work.decoded,
                to: work.decoded + n,
            });
        }
        parts
    }

    /// How many prompt tokens a round with `commits` commits takes: with
    /// no step budget, what fills its last decode of `n_batch`; with one,
    /// what is left of it after the commits, and never less than a quarter
    /// of it, so that prompts go on while commits fill the budget.
    fn prompt_room(&self, commits: usize) -> usize {
        match self.shared.step_tokens.load(Ordering::Relaxed) {
            0 => self.n_batch - commits % self.n_batch,
            budget => budget.saturating_sub(commits).max(budget.div_ceil(4)),
        }
    }

    /// Decode `parts`. When they do not fit the KV cache and belong to
    /// more than one group, the groups are split in halves and each half
    /// tried on its own, so the groups that fit land; a group that fails
    /// is marked failed as a whole.
    fn run_parts(&mut self, step: &mut Step, parts: &[Part]) {
        let Err(error) = self.decode_parts(step, parts) else {
            return;
        };
        let mut groups: Vec<usize> = Vec::new();
        for p in parts {
            if !groups.contains(&p.group) {
                groups.push(p.group);
            }
        }
        if matches!(error, Error::KvCacheFull(_)) && groups.len() > 1 {
            let (a, b) = groups.split_at(groups.len() / 2);
            for half in [a, b] {
                let some: Vec<Part> = parts
                    .iter()
                    .filter(|p| half.contains(&p.group))
                    .copied()
                    .collect();
                self.run_parts(step, &some);
            }
            return;
        }
        for g in groups {
            if let Some(p) = step.groups[g].progress.as_mut() {
                p.failed = Some(error.clone());
            }
        }
    }

    /// Decode `parts` in batches of `n_batch` tokens. Either every batch
    /// succeeds and each item takes its new logits and rows, or the cells
    /// of this round are removed again and nothing else changes.
    fn decode_parts(&mut self, step: &mut Step, parts: &[Part]) -> Result<()> {
        let mut captured: Vec<Captured> = parts.iter().map(|_| Captured::default()).collect();
        if let Err(e) = self.decode_batches(step, parts, &mut captured) {
            for p in parts {
                let w = work(step, p);
                let (seq, from) = (w.seq, w.start + p.from as i32);
                let _ = self.remove_cells(seq, u32::try_from(from).ok(), None);
                self.refresh_seq(seq);
            }
            return Err(e);
        }
        for (p, c) in parts.iter().zip(captured) {
            let w = work_mut(step, p);
            w.decoded = p.to;
            if c.fresh.is_some() {
                w.fresh = c.fresh;
            }
            w.rows.extend(c.rows);
        }
        Ok(())
    }

    fn decode_batches(
        &mut self,
        step: &Step,
        parts: &[Part],
        captured: &mut [Captured],
    ) -> Result<()> {
        let total: usize = parts.iter().map(|p| p.to - p.from).sum();
        let mut rows = Rows::default();
        let mut added = 0usize;
        self.batch.clear();
        for (i, p) in parts.iter().enumerate() {
            // Each adapter set's run of parts is decoded on its own (see
            // `by_adapters`).
            let set_changes = i > 0 && work(step, &parts[i - 1]).adapters != work(step, p).adapters;
            if set_changes && self.batch.n_tokens() > 0 {
                self.flush(&mut rows, captured)?;
            }
            self.use_adapters(&work(step, p).adapters)?;
            let keep_all = step.groups[p.group].all_rows;
            let w = work(step, p);
            for j in p.from..p.to {
                let last = j + 1 == w.tokens.len();
                let row = self.batch.n_tokens();
                if last {
                    rows.last.push((i, row, w.greedy));
                }
                if keep_all {
                    rows.all.push((i, row));
                }
                self.batch
                    .add(
                        LlamaToken(w.tokens[j]),
                        w.start + j as i32,
                        &[w.seq],
                        last || keep_all,
                    )
                    .map_err(|e| Error::Internal(format!("batch add: {e}")))?;
                added += 1;
                if self.batch.n_tokens() as usize >= self.n_batch || added == total {
                    self.flush(&mut rows, captured)?;
                }
            }
        }
        Ok(())
    }

    /// Decode the batch built so far and capture the rows it asked for.
    fn flush(&mut self, rows: &mut Rows, captured: &mut [Captured]) -> Result<()> {
        self.llama_decode(self.batch.n_tokens() as usize)?;
        for (i, row) in rows.all.drain(..) {
            captured[i]
                .rows
                .extend_from_slice(self.ctx.get_logits_ith(row));
        }
        let wanted: Vec<(i32, bool)> = rows.last.iter().map(|r| (r.1, r.2)).collect();
        let logits = self.rows_logits(&wanted);
        for ((i, ..), l) in rows.last.drain(..).zip(logits) {
            captured[i].fresh = Some(l);
        }
        self.batch.clear();
        Ok(())
    }

    /// Answer a finished group: a failed one is put back as it was; a
    /// successful one's branches advance and take their new logits.
    fn finish_group(&mut self, mut group: Group) {
        let Some(progress) = group.progress.take() else {
            return group
                .reply
                .send(Err(Error::Internal("a step group never ran".into())));
        };
        if let Some(error) = progress.failed {
            self.undo(progress.undo);
            lock(&self.shared.branches).clear_busy(group.ids);
            return group.reply.send(Err(error));
        }
        for w in &progress.work {
            self.refresh_seq(w.seq);
        }
        let shared = Arc::clone(&self.shared);
        let mut branches = lock(&shared.branches);
        for w in progress.work {
            if let Ok(b) = branches.get_mut(w.id) {
                b.position += w.tokens.len() as i32;
                if let Some((logits, stats)) = w.fresh {
                    if let Some(old) = b.replace_logits_with(logits, Some(stats)) {
                        self.recycle(old);
                    }
                }
                if group.all_rows {
                    b.rows = Some(w.rows);
                }
            }
        }
        branches.clear_busy(group.ids);
        drop(branches);
        group.reply.send(Ok(progress.results));
    }
}

/// Order `parts` so that each adapter set's parts come together, keeping
/// their order otherwise (commits first, then prompts in arrival order):
/// llama.cpp applies one set per decode, and rebuilds its compute graph
/// after each change (about 4 ms for SmolLM2 on the 2-core VM,
/// `bench/adapters.py`). The set applied now goes first, so a step that
/// alternates between two sets changes once, not twice.
fn by_adapters(step: &Step, parts: &mut [Part], current: &crate::adapter::Adapters) {
    let first = match parts.first() {
        Some(p) => &work(step, p).adapters,
        None => return,
    };
    if parts.iter().all(|p| work(step, p).adapters == *first) {
        return;
    }
    let mut sets: Vec<&crate::adapter::Adapters> = vec![current];
    let keys: Vec<usize> = parts
        .iter()
        .map(|p| {
            let set = &work(step, p).adapters;
            sets.iter().position(|s| *s == set).unwrap_or_else(|| {
                sets.push(set);
                sets.len() - 1
            })
        })
        .collect();
    let mut order: Vec<usize> = (0..parts.len()).collect();
    order.sort_by_key(|&i| keys[i]);
    let sorted: Vec<Part> = order.iter().map(|&i| parts[i]).collect();
    parts.copy_from_slice(&sorted);
}

fn work<'s>(step: &'s Step, p: &Part) -> &'s Work {
    &step.groups[p.group]
        .progress
        .as_ref()
        .expect("a planned group has started")
        .work[p.work]
}

fn work_mut<'s>(step: &'s mut Step, p: &Part) -> &'s mut Work {
    &mut step.groups[p.group]
        .progress
        .as_mut()
        .expect("a planned group has started")
        .work[p.work]
}
