//! The worker thread's loop and the decode primitives every job uses.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::DecodeError;

use super::shared::Shared;
use crate::error::{invalid, Error, Result};
use crate::model::Model;
use crate::params::ContextParams;
use crate::sync::lock;

/// Whether any context of this process has run a `llama_decode`.
pub(super) static DECODED: AtomicBool = AtomicBool::new(false);

/// The worker state, shared between the worker thread and callers that run
/// a short job inline.
pub(super) struct Engine {
    /// `None` once the context is closed (the worker thread frees it).
    pub(super) worker: Mutex<Option<Worker<'static>>>,
    /// Jobs submitted and not finished yet. Inline work runs only at zero,
    /// so it never overtakes a job submitted before it.
    pub(super) queued: AtomicUsize,
}

/// Everything the worker thread owns.
pub(crate) struct Worker<'m> {
    /// Work left running on llama.cpp's OpenMP threads after the last job
    /// (see `rounds`' `rows_logits`), finished before the next one.
    /// Dropped first, on the worker thread (the only one that may end it).
    pub(crate) background: Option<crate::omp::Background>,
    /// How many threads its decodes use (see `threads`).
    pub(crate) threads: crate::threads::Threads,
    /// The multimodal projector, once loaded (see `media`); it refers to
    /// the model, so it is declared (and dropped) before it.
    pub(crate) mtmd: Option<llama_cpp_2::mtmd::MtmdContext>,
    /// Borrows `model` (declared after it, so dropped before it).
    pub(crate) ctx: LlamaContext<'m>,
    pub(crate) model: Arc<Model>,
    pub(crate) batch: LlamaBatch<'static>,
    pub(crate) n_batch: usize,
    pub(crate) params: ContextParams,
    pub(crate) shared: Arc<Shared>,
    /// Branch logits buffers nobody holds any more, for reuse.
    pub(crate) logit_pool: Vec<Arc<[f32]>>,
    /// The adapter set applied to `ctx` now (see `adapter`).
    pub(crate) adapters: crate::adapter::Adapters,
    /// `ctx`'s C pointer, for the adapter calls llama-cpp-2 lacks.
    pub(crate) raw_ctx: Option<crate::adapter::RawContext>,
    /// Counted among the process's CPU contexts while it decodes on the
    /// CPU (see `omp::CpuContext`); None for a context offloaded to a GPU. Only held.
    #[allow(dead_code)]
    pub(crate) cpu: Option<crate::omp::CpuContext>,
}

impl Worker<'_> {
    /// Wait for (and help with) the background work of the last job; the
    /// worker thread calls this before anything that may use OpenMP. A
    /// no-op on any other thread (an inline job): only the worker may end
    /// the region, and inline jobs use no OpenMP.
    pub(crate) fn finish_background(&mut self) {
        if !self.background.as_ref().is_some_and(|b| b.is_mine()) {
            return;
        }
        if let Some(background) = self.background.take() {
            // A panic here (a bug in the background work) must not kill
            // the worker: the work only caches values readers recompute.
            let _ = catch_unwind(AssertUnwindSafe(|| background.finish()));
        }
    }

    /// Keep llama.cpp's OpenMP threads spinning until the next job (or
    /// `omp::LINGER`) instead of letting them fall asleep: call after a
    /// decode whose caller will soon decode again (see `omp::LINGER`).
    pub(crate) fn keep_team_awake(&mut self) {
        self.finish_background();
        if crate::omp::linger().is_zero() {
            return; // another context may want the cores: let the team sleep
        }
        let threads = self.threads.now();
        self.background = Some(crate::omp::Background::start(0, threads, Box::new(|_| {})));
    }

    fn check_decode(&self, tokens: &[i32], pos: i32, seq: i32) -> Result<usize> {
        if tokens.is_empty() {
            return Err(invalid("cannot decode an empty token list"));
        }
        self.model.check_tokens(tokens)?;
        let slot = self.shared.seq_slot(seq)?;
        if lock(&self.shared.branches).is_leased(seq) {
            return Err(invalid(format!(
                "seq_id {seq} is leased by a branch; use the branch (or prune it) instead"
            )));
        }
        if pos < 0 {
            return Err(invalid(format!("position must be >= 0, got {pos}")));
        }
        let expected = self.ctx.kv_cache_seq_pos_max(seq) + 1;
        if pos != expected {
            return Err(invalid(format!(
                "positions must continue sequence {seq}: next position is {expected}, got {pos} \
                 (remove KV cells first to rewrite a range)"
            )));
        }
        if i32::try_from(tokens.len())
            .ok()
            .and_then(|n| pos.checked_add(n))
            .is_none()
        {
            return Err(invalid("positions overflow i32"));
        }
        Ok(slot)
    }

    /// Re-read every sequence's largest position into the mirror.
    pub(crate) fn refresh_all(&self) {
        for slot in 0..self.shared.pos_max.len() {
            self.refresh_pos(slot, slot as i32);
        }
    }

    pub(crate) fn decode(&mut self, tokens: &[i32], pos: i32, seq: i32) -> Result<()> {
        let slot = self.check_decode(tokens, pos, seq)?;
        self.use_default_adapters()?;
        let mut next = pos;
        for (i, chunk) in tokens.chunks(self.n_batch).enumerate() {
            let last_chunk = (i + 1) * self.n_batch >= tokens.len();
            self.batch.clear();
            for (j, &t) in chunk.iter().enumerate() {
                let want_logits = last_chunk && j + 1 == chunk.len();
                self.batch
                    .add(LlamaToken(t), next, &[seq], want_logits)
                    .map_err(|e| Error::Internal(format!("batch add: {e}")))?;
                next += 1;
            }
            if let Err(e) = self.llama_decode(chunk.len()) {
                // Leave the sequence exactly as it was before this call.
                let _ = self.remove_cells(seq, u32::try_from(pos).ok(), None);
                self.refresh_pos(slot, seq);
                return Err(e);
            }
        }
        let last = self.batch.n_tokens() - 1;
        self.publish_logits(last);
        self.refresh_pos(slot, seq);
        self.keep_team_awake();
        Ok(())
    }

    /// Drop `seq`'s cells at positions `[p0, p1)` (`None`: open). With
    /// tombstones (the deterministic mode) they are handed to the tombstone
    /// sequence instead of freed: llama.cpp puts new tokens into the first
    /// free cells from the start of the cache, so a cell freed *before* a
    /// live sequence's cells would take one of its later tokens, out of
    /// position order, and its attention would sum in another order
    /// (docs/determinism.md). Tombstones are freed when the cache is full.
    pub(crate) fn remove_cells(
        &mut self,
        seq: i32,
        p0: Option<u32>,
        p1: Option<u32>,
    ) -> Result<()> {
        if let Some(tomb) = self.tomb() {
            if seq != tomb && self.ctx.kv_cache_seq_pos_max(seq) >= 0 {
                self.ctx
                    .copy_kv_cache_seq(seq, tomb, p0, p1)
                    .map_err(|e| Error::Internal(format!("KV tombstone copy failed: {e}")))?;
            }
        }
        self.ctx
            .kv_cache_seq_rm(seq, p0, p1)
            .map_err(|e| invalid(format!("could not remove KV cells: {e}")))
    }

    /// The tombstone sequence, if this context keeps one.
    pub(crate) fn tomb(&self) -> Option<i32> {
        self.params
            .tombstones()
            .then_some(self.params.n_seq_max as i32)
    }

    /// Free the tombstones' cells, if there are any (a full cache);
    /// whether some were freed.
    pub(crate) fn purge_tombstones(&mut self) -> bool {
        let Some(tomb) = self.tomb() else {
            return false;
        };
        if self.ctx.kv_cache_seq_pos_max(tomb) < 0 {
            return false;
        }
        let _ = self.ctx.kv_cache_seq_rm(tomb, None, None);
        self.shared
            .stats
            .tombstone_purges
            .fetch_add(1, Ordering::Relaxed);
        true
    }

    /// One `llama_decode` of the current batch, counted in the stats. With
    /// tombstones, a full cache frees them and tries once more.
    pub(crate) fn llama_decode(&mut self, n_tokens: usize) -> Result<()> {
        self.finish_background();
        DECODED.store(true, Ordering::Relaxed);
        let clock = self.threads.before();
        let started = Instant::now();
        let mut result = self.ctx.decode(&mut self.batch);
        if matches!(result, Err(DecodeError::NoKvCacheSlot)) && self.purge_tombstones() {
            result = self.ctx.decode(&mut self.batch);
        }
        if let Some(n) = self.threads.after(clock, started.elapsed()) {
            self.set_threads(n);
        }
        let stats = &self.shared.stats;
        stats.decode_calls.fetch_add(1, Ordering::Relaxed);
        stats
            .decode_micros
            .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        match result {
            Ok(()) => {
                stats
                    .tokens_decoded
                    .fetch_add(n_tokens as u64, Ordering::Relaxed);
                Ok(())
            }
            Err(DecodeError::NoKvCacheSlot) => Err(Error::KvCacheFull(format!(
                "no room for {n_tokens} more tokens in a KV cache of n_ctx={} cells; \
                 free cells (kv_cache_remove / prune) or create the context with a larger n_ctx",
                self.ctx.n_ctx()
            ))),
            Err(e) => Err(Error::Decode(e.to_string())),
        }
    }

    /// Decode with `n` threads from now on (see `threads`).
    fn set_threads(&mut self, n: u32) {
        if let Some(raw) = &self.raw_ctx {
            let n = i32::try_from(n).unwrap_or(1);
            // SAFETY: the worker thread owns the context; no decode runs.
            unsafe { llama_cpp_sys_2::llama_set_n_threads(raw.0.as_ptr(), n, n) };
            self.shared.threads.store(n as usize, Ordering::Relaxed);
        }
    }

    /// Copy batch row `row`'s logits into the shared snapshot, reusing the
    /// previous snapshot's buffer when no reader holds it any more.
    fn publish_logits(&mut self, row: i32) {
        let fresh = self.ctx.get_logits_ith(row);
        let mut slot = lock(&self.shared.logits);
        match slot.as_mut().and_then(Arc::get_mut) {
            Some(buf) if buf.len() == fresh.len() => buf.copy_from_slice(fresh),
            _ => *slot = Some(Arc::from(fresh)),
        }
    }

    pub(crate) fn refresh_pos(&self, slot: usize, seq: i32) {
        self.shared.pos_max[slot].store(self.ctx.kv_cache_seq_pos_max(seq), Ordering::Release);
    }
}
