//! What the worker publishes for callers on other threads.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{invalid, Result};
use crate::sampling::Sampler;
use crate::state::Branches;

/// Counters a user can reason with; tests use them to prove batching.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Calls to `llama_decode`.
    pub decode_calls: u64,
    /// Tokens submitted to `llama_decode`.
    pub tokens_decoded: u64,
    /// Wall time spent inside `llama_decode`, in seconds. GPU backends
    /// return before the computation ends (the wait is in reading the
    /// logits), so there this undercounts.
    pub decode_seconds: f64,
    /// Times a full cache freed the deterministic mode's removed cells
    /// (`Worker::remove_cells`); from then on a token may land before its
    /// prefix's cells, and bit-identity with other routes is not promised.
    pub tombstone_purges: u64,
    /// Images and audio clips encoded (`media`): a fork of a branch that
    /// holds one shares its cells and encodes nothing.
    pub media_encodes: u64,
}

#[derive(Default)]
pub(crate) struct StatCounters {
    pub(crate) decode_calls: AtomicU64,
    pub(crate) tokens_decoded: AtomicU64,
    pub(crate) decode_micros: AtomicU64,
    pub(crate) tombstone_purges: AtomicU64,
    pub(crate) media_encodes: AtomicU64,
}

/// State the worker publishes for callers on other threads.
pub(crate) struct Shared {
    pub(crate) closed: AtomicBool,
    pub(crate) stats: StatCounters,
    /// Largest position per sequence, mirrored after every KV change.
    pub(crate) pos_max: Vec<AtomicI32>,
    /// Logits of the last decoded token (the context's "current" logits).
    pub(crate) logits: Mutex<Option<Arc<[f32]>>>,
    /// The flat loop's sampler: its penalty history persists across calls.
    pub(crate) sampler: Mutex<Option<Sampler>>,
    /// Every branch and the free KV leases.
    pub(crate) branches: Mutex<Branches>,
    /// The adapter set of new branches, the flat API and embeddings.
    pub(crate) default_adapters: Mutex<crate::adapter::Adapters>,
    /// Embeddings of the last `encode`.
    pub(crate) embeddings: Mutex<Option<Embeddings>>,
    /// The most tokens a step's round decodes (0: `n_batch`); see
    /// [`Context::set_step_tokens`](crate::Context::set_step_tokens).
    pub(crate) step_tokens: AtomicUsize,
    /// The threads the worker's decodes use now (see `threads`).
    pub(crate) threads: AtomicUsize,
    /// The next job panics (`Context::panic_next_job`).
    #[cfg(feature = "testing")]
    pub(crate) panic_next: AtomicBool,
}

impl Shared {
    /// Whether the flat API's cells are in sequence `seq` (as of the last
    /// finished job): such a sequence is never leased to a branch.
    pub(crate) fn holds_flat_data(&self, seq: i32) -> bool {
        usize::try_from(seq)
            .ok()
            .and_then(|s| self.pos_max.get(s))
            .is_some_and(|p| p.load(Ordering::Acquire) >= 0)
    }

    /// Mirror `seq` as empty ahead of a queued job that empties it.
    pub(crate) fn forget_seq(&self, seq: i32) {
        if let Some(p) = usize::try_from(seq).ok().and_then(|s| self.pos_max.get(s)) {
            p.store(-1, Ordering::Release);
        }
    }

    /// Index of `seq` in the per-sequence tables, or an error naming the range.
    pub(crate) fn seq_slot(&self, seq: i32) -> Result<usize> {
        usize::try_from(seq)
            .ok()
            .filter(|&s| s < self.pos_max.len())
            .ok_or_else(|| {
                invalid(format!(
                    "seq_id {seq} is out of range [0, {}) (n_seq_max)",
                    self.pos_max.len()
                ))
            })
    }
}

/// The embeddings of the last `encode`: one row when pooled, one row per
/// token otherwise.
#[derive(Debug, Clone, PartialEq)]
pub struct Embeddings {
    pub rows: usize,
    pub dim: usize,
    pub data: Vec<f32>,
}
