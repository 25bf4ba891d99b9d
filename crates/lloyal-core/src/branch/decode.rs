//! Commits and prefills: the tokens of many branches in one decode, and
//! the undo that leaves every branch as it was when a decode fails.

use std::sync::Arc;

use llama_cpp_2::token::LlamaToken;

use super::job::ItemResults;
use super::scan::{copy_and_scan, log_sum_exps, reuse, BACKGROUND_SUMS_UP_TO};
use super::state::{BranchId, BranchState};
use crate::engine::Worker;
use crate::error::{Error, Result};
use crate::grammar::Grammar;
use crate::metrics::LogitStats;
use crate::sampling::Sampler;
use crate::sync::lock;

/// A branch's new logits after a decode: (branch, positions advanced,
/// (snapshot, its stats)).
pub(super) type Fresh = (BranchId, i32, (Arc<[f32]>, LogitStats));

/// What a commit may have to undo.
pub(super) struct Undo {
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
    pub(super) fn shared_pos_len(&self) -> i32 {
        lock(&self.shared.branches).n_seq_max() as i32
    }

    /// Put the KV cache and the branches back as they were before a failed
    /// batch. KV first (no lock held), then the Rust-side state.
    pub(super) fn undo(&mut self, undo: Vec<Undo>) {
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
    pub(super) fn apply(&mut self, fresh: Vec<Fresh>) {
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
    pub(super) fn recycle(&mut self, old: Arc<[f32]>) {
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
    pub(super) fn rows_logits(&mut self, rows: &[(i32, bool)]) -> Vec<(Arc<[f32]>, LogitStats)> {
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
    pub(super) fn decode_or_undo(&mut self, undo: &mut Option<Vec<Undo>>) -> Result<()> {
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
    pub(super) fn commit(&mut self, items: &[(BranchId, i32)]) -> Result<ItemResults> {
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

    pub(super) fn commit_split(&mut self, items: &[(BranchId, i32)]) -> Result<ItemResults> {
        match self.commit(items) {
            Err(e @ Error::KvCacheFull(_)) => Ok(vec![Err(e)]),
            other => other,
        }
    }

    pub(super) fn commit_once(&mut self, items: &[(BranchId, i32)]) -> Result<ItemResults> {
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

    pub(super) fn prefill(
        &mut self,
        items: &[(BranchId, Vec<i32>)],
        all_rows: bool,
    ) -> Result<ItemResults> {
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

impl Undo {
    pub(super) fn of(id: BranchId, b: &BranchState) -> Self {
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
