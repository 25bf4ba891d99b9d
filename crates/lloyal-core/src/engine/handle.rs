//! The `Context` handle: submitting jobs, running short ones inline,
//! closing.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use tokio::sync::mpsc::error::SendError;
use tokio::sync::mpsc::{UnboundedSender, WeakUnboundedSender};

use super::job::{Hold, Job};
use super::reply::Reply;
use super::shared::{Shared, Stats};
use super::worker::{Engine, Worker};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::params::ContextParams;
use crate::sync::lock;

/// A handle to a context. Dropping it closes the context (without waiting).
pub struct Context {
    pub(super) model: Arc<Model>,
    pub(super) params: ContextParams,
    pub(super) sender: Mutex<Option<UnboundedSender<Job>>>,
    pub(crate) shared: Arc<Shared>,
    pub(super) engine: Arc<Engine>,
    pub(super) n_ctx: u32,
}

/// The name of every context's worker thread.
pub const WORKER_THREAD_NAME: &str = "lloyal-worker";

/// Every worker thread started and not yet joined.
pub(super) static WORKERS: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());

/// How to close a running worker's context without its handle: weak, so
/// that the registry keeps no context open.
pub(super) struct Closer {
    pub(super) sender: WeakUnboundedSender<Job>,
    pub(super) shared: Weak<Shared>,
}

/// The contexts whose workers have started, for [`join_workers`].
pub(super) static OPEN: Mutex<Vec<Closer>> = Mutex::new(Vec::new());

/// Close every context still open, then wait for every worker thread to
/// exit. An embedding runtime calls this before it shuts down (Python: at
/// exit), so that no worker is still running a reply callback while the
/// runtime is torn down. Contexts are closed here whoever holds their
/// handle: a handle the runtime will never drop (Python defers the release
/// of objects a worker let go of without the GIL) must not keep a worker,
/// and so the process, waiting for a close that never comes.
pub fn join_workers() {
    for closer in std::mem::take(&mut *lock(&OPEN)) {
        let (Some(sender), Some(shared)) = (closer.sender.upgrade(), closer.shared.upgrade())
        else {
            continue;
        };
        if !shared.closed.swap(true, Ordering::AcqRel) {
            // A failed send means the worker is gone already.
            let _ = sender.send(Job::Close {
                reply: Reply::new(|_| {}),
            });
        }
    }
    let handles = std::mem::take(&mut *lock(&WORKERS));
    for handle in handles {
        let _ = handle.join();
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("model", &self.model.info().name)
            .field("params", &self.params)
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl Context {
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn params(&self) -> &ContextParams {
        &self.params
    }

    /// KV cells actually allocated: llama.cpp rounds the requested `n_ctx`
    /// up (to a multiple of 256 with unified KV).
    pub fn n_ctx(&self) -> u32 {
        self.n_ctx
    }

    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Acquire)
    }

    pub(crate) fn check_open(&self) -> Result<()> {
        if self.is_closed() {
            Err(Error::ContextClosed)
        } else {
            Ok(())
        }
    }

    pub(crate) fn submit(&self, job: Job) {
        // A step counts once per group: the worker finishes its groups
        // one by one (see `run`), and inline work waits for them all.
        let count = match &job {
            Job::Step(step) => step.groups.len(),
            _ => 1,
        };
        let sender = lock(&self.sender).clone();
        match sender {
            Some(tx) if !self.is_closed() => {
                self.engine.queued.fetch_add(count, Ordering::SeqCst);
                if let Err(SendError(job)) = tx.send(job) {
                    self.engine.queued.fetch_sub(count, Ordering::SeqCst);
                    job.fail(Error::ContextClosed);
                }
            }
            _ => job.fail(Error::ContextClosed),
        }
    }

    /// Run `f` on the calling thread if the worker is idle (no job queued
    /// or running); `None` if it is busy or the context is closed, and the
    /// caller should submit a job instead. Skipping the hand-off to the
    /// worker and back saves two thread wake-ups, which is most of the cost
    /// of a fork or prune. Never blocks: a decode in progress holds the
    /// worker, so `f` should be short work that needs no GIL.
    pub(crate) fn run_inline<T>(
        &self,
        f: impl FnOnce(&mut Worker<'static>) -> Result<T>,
    ) -> Option<Result<T>> {
        let mut guard = match self.engine.worker.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return None,
        };
        if self.engine.queued.load(Ordering::SeqCst) != 0 || self.is_closed() {
            return None;
        }
        let worker = guard.as_mut()?;
        Some(
            catch_unwind(AssertUnwindSafe(|| f(worker)))
                .unwrap_or_else(|p| Err(Error::from_panic(p))),
        )
    }

    /// Hold the worker until the returned guard is dropped: what is
    /// queued before the hold runs, jobs submitted meanwhile wait behind
    /// it, in order (nothing runs inline), and the worker takes them all at
    /// once when the guard drops (steps queued back to back merge, as
    /// always). A test device: tests use it to have work queued at a given
    /// moment, whatever the speed of the machine; batching does not use it.
    /// A guard that is never dropped stalls the context, `close` included.
    pub fn hold(&self) -> Hold {
        let (tx, rx) = crossbeam_channel::bounded(0);
        self.submit(Job::Hold { until: rx });
        Hold { _release: tx }
    }

    /// Requests queued or running on the worker now (tests).
    #[doc(hidden)]
    pub fn queued(&self) -> usize {
        self.engine.queued.load(Ordering::SeqCst)
    }

    /// Close: queued jobs fail with [`Error::ContextClosed`], the llama.cpp
    /// context is freed, then `reply` is called. Closing twice is a no-op.
    pub fn close(&self, reply: Reply<()>) {
        let was_closed = self.shared.closed.swap(true, Ordering::AcqRel);
        let sender = lock(&self.sender).take();
        match sender {
            Some(tx) if !was_closed => {
                // A failed send means the worker is gone already: nothing to free.
                self.engine.queued.fetch_add(1, Ordering::SeqCst);
                if let Err(SendError(Job::Close { reply })) = tx.send(Job::Close { reply }) {
                    reply.send(Ok(()));
                }
            }
            _ => reply.send(Ok(())),
        }
    }

    /// Blocking [`Context::close`]. Do not call this from a thread that the
    /// worker's reply callbacks need (for Python: release the GIL first).
    pub fn close_blocking(&self) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.close(Reply::new(move |r| {
            let _ = tx.send(r);
        }));
        let _ = rx.recv();
    }

    /// The most tokens one round of a step decodes (see `engine::step`):
    /// commits first, then prompt chunks up to the budget, so that while
    /// branches stream, a long prompt is decoded a budget at a time beside
    /// them instead of stalling them for a whole `n_batch`. Prompts still
    /// get at least a quarter of the budget in a round that commits fill.
    /// `None` (the default): `n_batch`. Takes effect from the next round.
    pub fn set_step_tokens(&self, tokens: Option<u32>) -> Result<()> {
        let n = match tokens {
            None => 0,
            Some(0) => return Err(crate::error::invalid("step_tokens must be >= 1 (or None)")),
            Some(n) => (n as usize).min(self.params.n_batch as usize),
        };
        self.shared.step_tokens.store(n, Ordering::Relaxed);
        Ok(())
    }

    /// The budget [`set_step_tokens`](Self::set_step_tokens) set (at most
    /// `n_batch`), or `None`.
    pub fn step_tokens(&self) -> Option<u32> {
        match self.shared.step_tokens.load(Ordering::Relaxed) {
            0 => None,
            n => Some(n as u32),
        }
    }

    /// The threads its decodes use now: `n_threads`, or, for a CPU context
    /// created without it, fewer while the machine has more runnable
    /// threads than cores (see `threads`).
    pub fn decode_threads(&self) -> u32 {
        self.shared.threads.load(Ordering::Relaxed) as u32
    }

    pub fn stats(&self) -> Stats {
        let s = &self.shared.stats;
        Stats {
            decode_calls: s.decode_calls.load(Ordering::Relaxed),
            tokens_decoded: s.tokens_decoded.load(Ordering::Relaxed),
            decode_seconds: s.decode_micros.load(Ordering::Relaxed) as f64 / 1e6,
            tombstone_purges: s.tombstone_purges.load(Ordering::Relaxed),
            media_encodes: s.media_encodes.load(Ordering::Relaxed),
        }
    }

    /// Model weights plus the KV cache at full size, in bytes. The KV part
    /// is computed from the GGUF hyper-parameters (an estimate: llama.cpp
    /// adds small compute buffers on top).
    pub fn memory_size(&self) -> u64 {
        self.model.info().size_bytes + self.kv_cache_bytes()
    }

    fn kv_cache_bytes(&self) -> u64 {
        self.model
            .kv_bytes_per_cell(self.params.type_k, self.params.type_v)
            .saturating_mul(u64::from(self.n_ctx))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // Never join here: the worker may be waiting for the thread that
        // drops us (e.g. for Python's GIL) to deliver a reply.
        self.close(Reply::new(|_| {}));
    }
}
