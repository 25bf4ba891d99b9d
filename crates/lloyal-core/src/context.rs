//! A llama.cpp context driven by one worker thread.
//!
//! llama.cpp contexts are not thread-safe, so the worker thread owns the
//! context and its batch; everything else sends it [`Job`]s over a channel
//! and gets the result through a reply callback. The worker drains whatever
//! is pending before it runs, so bursts of requests are handled together.
//! Cheap reads (the last logits, positions, statistics) are mirrored into
//! [`Shared`] so callers never wait behind a running decode to read them.
//!
//! Short jobs (fork, prune) can also run on the caller's thread when the
//! worker is idle: nothing queued, nothing running (see
//! [`Context::run_inline`]). The worker state sits behind a mutex for that;
//! the worker thread holds it while it runs a job, so the context is still
//! used by one thread at a time, and in submission order.

use std::num::NonZeroU32;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::DecodeError;

use crate::backend::{backend, CONTEXT_CREATION};
use crate::error::{invalid, Error, Result};
use crate::metrics::{self, Base};
use crate::model::Model;
use crate::params::ContextParams;
use crate::sampling::{Sampler, SamplingParams};

/// How a job's result is handed back: [`Reply::send`] calls the function
/// once, on the worker thread; it must not block for long (it only
/// completes a future). A reply dropped unsent (a job that panicked, a
/// worker that never started) answers [`Error::Internal`] instead, so no
/// caller waits forever.
pub struct Reply<T: 'static>(Option<Box<dyn FnOnce(Result<T>) + Send + 'static>>);

impl<T: 'static> Reply<T> {
    pub fn new(f: impl FnOnce(Result<T>) + Send + 'static) -> Self {
        Reply(Some(Box::new(f)))
    }

    /// Answer with `result`.
    pub fn send(mut self, result: Result<T>) {
        if let Some(f) = self.0.take() {
            f(result);
        }
    }
}

impl<T: 'static> Drop for Reply<T> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            let panicking = std::thread::panicking();
            // After the job (on the worker): once the worker has freed the
            // job's branches, so the caller finds them usable, and knows
            // what the panic said (`run` keeps it in `PANIC`).
            after_job(Box::new(move || {
                let why = match PANIC.with(|p| p.borrow().clone()) {
                    Some(message) if panicking => {
                        format!("the engine panicked while running this request: {message}")
                    }
                    _ if panicking => "the engine panicked while running this request".to_owned(),
                    _ => "the engine dropped this request without an answer".to_owned(),
                };
                f(Err(Error::Internal(format!(
                    "{why} (a bug in lloyal: please report it)"
                ))));
            }));
        }
    }
}

pub(crate) enum Job {
    Decode {
        tokens: Vec<i32>,
        pos: i32,
        seq: i32,
        reply: Reply<()>,
    },
    /// Branch work (see `store.rs`).
    Branch(crate::store::BranchJob),
    /// KV cache work of the flat API (see `kv_cache.rs`).
    Kv(crate::kv_cache::KvJob),
    /// Embeddings (see `embed.rs`).
    Embed(crate::embed::EmbedJob),
    Close {
        reply: Reply<()>,
    },
    /// Keep the worker busy until the sender side is dropped (see
    /// [`Context::hold_worker`]).
    Hold {
        until: Receiver<()>,
    },
}

impl Job {
    fn fail(self, error: Error) {
        match self {
            Job::Decode { reply, .. } | Job::Close { reply } => reply.send(Err(error)),
            Job::Branch(job) => job.fail(error),
            Job::Kv(job) => job.fail(error),
            Job::Embed(job) => job.fail(error),
            Job::Hold { .. } => {}
        }
    }
}

/// See [`Context::hold_worker`]: the worker resumes when this is dropped.
#[doc(hidden)]
pub struct WorkerHold {
    _release: Sender<()>,
}

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
}

#[derive(Default)]
struct StatCounters {
    decode_calls: AtomicU64,
    tokens_decoded: AtomicU64,
    decode_micros: AtomicU64,
    tombstone_purges: AtomicU64,
}

/// State the worker publishes for callers on other threads.
pub(crate) struct Shared {
    closed: AtomicBool,
    stats: StatCounters,
    /// Largest position per sequence, mirrored after every KV change.
    pos_max: Vec<AtomicI32>,
    /// Logits of the last decoded token (the context's "current" logits).
    logits: Mutex<Option<Arc<[f32]>>>,
    /// The flat loop's sampler: its penalty history persists across calls.
    sampler: Mutex<Option<Sampler>>,
    /// Every branch and the free KV leases.
    pub(crate) branches: Mutex<crate::branch::Branches>,
    /// Embeddings of the last `encode`.
    pub(crate) embeddings: Mutex<Option<crate::embed::Embeddings>>,
    /// The next job panics (`Context::panic_next_job`).
    #[cfg(feature = "testing")]
    panic_next: AtomicBool,
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
    fn seq_slot(&self, seq: i32) -> Result<usize> {
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

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks cannot leave their plain data
    // half-written, so a poisoned lock is still safe to use.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A handle to a context. Dropping it closes the context (without waiting).
pub struct Context {
    model: Arc<Model>,
    params: ContextParams,
    sender: Mutex<Option<Sender<Job>>>,
    pub(crate) shared: Arc<Shared>,
    engine: Arc<Engine>,
    n_ctx: u32,
}

/// The worker state, shared between the worker thread and callers that run
/// a short job inline.
struct Engine {
    /// `None` once the context is closed (the worker thread frees it).
    worker: Mutex<Option<Worker<'static>>>,
    /// Jobs submitted and not finished yet. Inline work runs only at zero,
    /// so it never overtakes a job submitted before it.
    queued: AtomicUsize,
}

/// The name of every context's worker thread.
pub const WORKER_THREAD_NAME: &str = "lloyal-worker";

/// Every worker thread started and not yet joined.
static WORKERS: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());

/// Wait for every worker thread to exit. Workers exit once their context is
/// closed (or dropped), so close contexts first. An embedding runtime calls
/// this before it shuts down (Python: at exit), so that no worker is still
/// running a reply callback while the runtime is torn down.
pub fn join_workers() {
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

/// Whether any context of this process has run a `llama_decode`.
static DECODED: AtomicBool = AtomicBool::new(false);

/// Make llama.cpp's CPU matmuls of K-quant weights take the dot-product
/// path at every batch size: its tiled GEMM (from 8 rows) sums in another
/// order. The switch, `GGML_CPU_TILED_MM=0`, is read once per process at
/// the first such matmul, so it is set here before any decode, or must
/// already be in the environment.
fn plain_k_quant_matmuls() -> Result<()> {
    const VAR: &str = "GGML_CPU_TILED_MM";
    match std::env::var(VAR) {
        Ok(v) if v.trim().parse::<i64>() == Ok(0) => Ok(()),
        Ok(v) => Err(invalid(format!(
            "deterministic=True needs {VAR}=0 (llama.cpp's tiled K-quant matmul depends on the \
             batch size); the environment sets it to {v:?}"
        ))),
        Err(_) if !DECODED.load(Ordering::Relaxed) => {
            std::env::set_var(VAR, "0");
            Ok(())
        }
        Err(_) => Err(invalid(format!(
            "deterministic=True must be set up before this process decodes anything: \
             llama.cpp reads {VAR} once per process. Open the deterministic context first, \
             or start the process with {VAR}=0"
        ))),
    }
}

impl Context {
    /// Load the model and create the context on a new worker thread.
    /// `on_ready` is called from that thread with the handle or the error.
    pub fn open(model_path: PathBuf, mut params: ContextParams, on_ready: Reply<Context>) {
        if let Err(e) = params.validate().and_then(|()| {
            if params.deterministic {
                plain_k_quant_matmuls()
            } else {
                Ok(())
            }
        }) {
            on_ready.send(Err(e));
            return;
        }
        params.n_batch = effective_n_batch(&params);
        // The reply stays reachable here until the thread has taken it, so
        // a thread that cannot be started still answers.
        let slot = Arc::new(Mutex::new(Some(on_ready)));
        let taken = Arc::clone(&slot);
        let spawned = std::thread::Builder::new()
            .name(WORKER_THREAD_NAME.into())
            .spawn(move || {
                let mut on_ready = lock(&taken).take();
                let outcome = catch_unwind(AssertUnwindSafe(|| {
                    worker_main(model_path, params, &mut on_ready)
                }));
                if let Err(panic) = outcome {
                    if let Some(ready) = on_ready.take() {
                        ready.send(Err(Error::from_panic(panic)));
                    }
                }
            });
        match spawned {
            Ok(handle) => {
                let mut workers = lock(&WORKERS);
                workers.retain(|h| !h.is_finished());
                workers.push(handle);
            }
            Err(e) => {
                if let Some(ready) = lock(&slot).take() {
                    ready.send(Err(Error::Internal(format!(
                        "could not start the context's worker thread: {e}"
                    ))));
                }
            }
        }
    }

    /// Make the next job the worker runs panic before it starts (feature
    /// `testing`): its caller must get an error and the context must stay
    /// usable.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn panic_next_job(&self) {
        self.shared.panic_next.store(true, Ordering::SeqCst);
    }

    /// Blocking [`Context::open`], for Rust callers and tests.
    pub fn open_blocking(model_path: impl Into<PathBuf>, params: ContextParams) -> Result<Context> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        Context::open(
            model_path.into(),
            params,
            Reply::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv()
            .map_err(|_| Error::Internal("worker exited before reporting".into()))?
    }

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
        let sender = lock(&self.sender).clone();
        match sender {
            Some(tx) if !self.is_closed() => {
                self.engine.queued.fetch_add(1, Ordering::SeqCst);
                if let Err(crossbeam_channel::SendError(job)) = tx.send(job) {
                    self.engine.queued.fetch_sub(1, Ordering::SeqCst);
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

    /// Decode `tokens` into sequence `seq` starting at `pos`, which must
    /// continue the sequence (`kv_seq_pos_max(seq) + 1`). Inputs longer than
    /// `n_batch` are split across several `llama_decode` calls; if any of
    /// them fails, what this call added to the KV cache is removed again.
    pub fn decode(&self, tokens: Vec<i32>, pos: i32, seq: i32, reply: Reply<()>) {
        self.submit(Job::Decode {
            tokens,
            pos,
            seq,
            reply,
        });
    }

    /// Blocking [`Context::decode`].
    pub fn decode_blocking(&self, tokens: Vec<i32>, pos: i32, seq: i32) -> Result<()> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.decode(
            tokens,
            pos,
            seq,
            Reply::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv().map_err(|_| Error::ContextClosed)?
    }

    /// Occupy the worker until the returned guard is dropped: jobs submitted
    /// meanwhile queue up behind it, in order, and nothing runs inline. For
    /// tests that need work to be queued (not finished) at a given moment,
    /// whatever the speed of the machine; a guard that is never dropped
    /// stalls the context, `close` included.
    #[doc(hidden)]
    pub fn hold_worker(&self) -> WorkerHold {
        let (tx, rx) = crossbeam_channel::bounded(0);
        self.submit(Job::Hold { until: rx });
        WorkerHold { _release: tx }
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
                if let Err(crossbeam_channel::SendError(Job::Close { reply })) =
                    tx.send(Job::Close { reply })
                {
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

    /// Largest position held for `seq` (`-1` when empty).
    pub fn kv_seq_pos_max(&self, seq: i32) -> Result<i32> {
        self.check_open()?;
        let slot = self.seq_slot(seq)?;
        Ok(self.shared.pos_max[slot].load(Ordering::Acquire))
    }

    fn seq_slot(&self, seq: i32) -> Result<usize> {
        self.shared.seq_slot(seq)
    }

    /// A copy of the last decoded token's logits.
    pub fn logits(&self) -> Result<Arc<[f32]>> {
        self.check_open()?;
        lock(&self.shared.logits)
            .clone()
            .ok_or_else(|| invalid("no logits yet: decode at least one token first"))
    }

    /// Sample from `logits` (or the context's last logits) with the flat
    /// loop's persistent sampler, reconfigured to `params` when they differ.
    /// The sampled token enters the sampler's penalty history.
    pub fn sample(&self, params: &SamplingParams, logits: Option<&[f32]>) -> Result<i32> {
        self.check_open()?;
        let current;
        let logits = match logits {
            Some(l) => {
                self.check_logits_len(l)?;
                l
            }
            None => {
                current = self.logits()?;
                &current
            }
        };
        let mut guard = lock(&self.shared.sampler);
        let sampler = match guard.as_mut() {
            Some(s) => {
                if s.params() != params {
                    s.set_params(params.clone())?;
                    self.model.bind_sampler(s);
                }
                s
            }
            None => {
                let s = guard.insert(Sampler::new(params.clone())?);
                self.model.bind_sampler(s);
                s
            }
        };
        sampler.sample(logits)
    }

    /// The most likely next token under the last logits (plain argmax).
    pub fn greedy_sample(&self) -> Result<i32> {
        let logits = self.logits()?;
        crate::sampling::greedy(&logits)
            .ok_or_else(|| invalid("every logit is -inf or NaN: nothing can be sampled"))
    }

    /// Forget the flat sampler's penalty history (and its RNG state).
    pub fn reset_sampler(&self) {
        *lock(&self.shared.sampler) = None;
    }

    pub fn check_logits_len(&self, logits: &[f32]) -> Result<()> {
        let n = self.model.vocab_size() as usize;
        if logits.len() != n {
            return Err(invalid(format!(
                "logits must have shape ({n},), got ({},)",
                logits.len()
            )));
        }
        Ok(())
    }

    fn logits_or_current(&self, logits: Option<&[f32]>) -> Result<Arc<[f32]>> {
        match logits {
            Some(l) => {
                self.check_logits_len(l)?;
                Ok(Arc::from(l))
            }
            None => self.logits(),
        }
    }

    pub fn model_entropy(&self, base: Base, logits: Option<&[f32]>) -> Result<f64> {
        metrics::entropy(&self.logits_or_current(logits)?, base)
    }

    pub fn model_surprisal(&self, token: i32, base: Base, logits: Option<&[f32]>) -> Result<f64> {
        self.model.check_token(token)?;
        metrics::surprisal(&self.logits_or_current(logits)?, token, base)
    }

    pub fn stats(&self) -> Stats {
        let s = &self.shared.stats;
        Stats {
            decode_calls: s.decode_calls.load(Ordering::Relaxed),
            tokens_decoded: s.tokens_decoded.load(Ordering::Relaxed),
            decode_seconds: s.decode_micros.load(Ordering::Relaxed) as f64 / 1e6,
            tombstone_purges: s.tombstone_purges.load(Ordering::Relaxed),
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

/// Everything the worker thread owns.
pub(crate) struct Worker<'m> {
    /// Work left running on llama.cpp's OpenMP threads after the last job
    /// (see `store::Worker::rows_logits`), finished before the next one.
    /// Dropped first, on the worker thread (the only one that may end it).
    pub(crate) background: Option<crate::omp::Background>,
    /// Borrows `model` (declared after it, so dropped before it).
    pub(crate) ctx: LlamaContext<'m>,
    pub(crate) model: Arc<Model>,
    pub(crate) batch: LlamaBatch<'static>,
    pub(crate) n_batch: usize,
    pub(crate) params: ContextParams,
    pub(crate) shared: Arc<Shared>,
    /// Branch logits buffers nobody holds any more, for reuse.
    pub(crate) logit_pool: Vec<Arc<[f32]>>,
}

fn worker_main(model_path: PathBuf, params: ContextParams, on_ready: &mut Option<Reply<Context>>) {
    let model = match Model::load(&model_path, params.n_gpu_layers, !params.deterministic) {
        Ok(m) => m,
        Err(e) => {
            if let Some(ready) = on_ready.take() {
                ready.send(Err(e));
            }
            return;
        }
    };
    let ctx =
        match check_memory(&model, &params).and_then(|()| create_llama_context(&model, &params)) {
            Ok(c) => c,
            Err(e) => {
                if let Some(ready) = on_ready.take() {
                    ready.send(Err(e));
                }
                return;
            }
        };
    let (tx, rx) = crossbeam_channel::unbounded();
    let shared = Arc::new(Shared {
        closed: AtomicBool::new(false),
        stats: StatCounters::default(),
        pos_max: (0..params.n_seq_max).map(|_| AtomicI32::new(-1)).collect(),
        logits: Mutex::new(None),
        sampler: Mutex::new(None),
        branches: Mutex::new(crate::branch::Branches::new(params.n_seq_max)),
        embeddings: Mutex::new(None),
        #[cfg(feature = "testing")]
        panic_next: AtomicBool::new(false),
    });
    let n_batch = params.n_batch as usize;
    let engine = Arc::new(Engine {
        worker: Mutex::new(None),
        queued: AtomicUsize::new(0),
    });
    let handle = Context {
        model: Arc::clone(&model),
        params: params.clone(),
        sender: Mutex::new(Some(tx)),
        shared: Arc::clone(&shared),
        engine: Arc::clone(&engine),
        n_ctx: ctx.n_ctx(),
    };
    // SAFETY: `ctx` borrows the `LlamaModel` inside `model`'s heap
    // allocation, which does not move and lives as long as any `Arc<Model>`.
    // The worker holds one such `Arc` and drops `ctx` before it (field
    // order), so the borrow outlives nothing it points to; `'static` only
    // lets the worker be shared with callers that run inline jobs.
    let ctx = unsafe { std::mem::transmute::<LlamaContext<'_>, LlamaContext<'static>>(ctx) };
    let worker = Worker {
        background: None,
        ctx,
        model: Arc::clone(&model),
        // A token may belong to every sequence (a shared prefix of a
        // token tree, `branch_prefill_tree`).
        batch: LlamaBatch::new(n_batch, params.n_seq_max as i32),
        n_batch,
        params,
        shared,
        logit_pool: Vec::new(),
    };
    *lock(&engine.worker) = Some(worker);
    if let Some(ready) = on_ready.take() {
        ready.send(Ok(handle));
    }
    run(&engine, &rx);
}

/// The batch size lloyal splits inputs at, which is the one llama.cpp uses.
///
/// llama.cpp clamps `n_batch` to `n_ctx` for causal models and asserts
/// (aborts the process) when a decode holds more tokens than that, so a
/// split at the requested value (`n_ctx=256` with the default 512) would
/// abort: clamp first, to the requested `n_ctx` (llama.cpp only ever
/// allocates more cells than asked for). It also reserves one output row
/// per sequence within `n_batch` and asserts on fewer, so `n_batch` is at
/// least `n_seq_max` (which `validate` keeps within `n_ctx`). Embedding
/// contexts also need a multiple of `n_seq_max` (llama.cpp splits their
/// batches evenly across sequences and asserts otherwise): round up, or
/// down where up would pass `n_ctx`.
fn effective_n_batch(params: &ContextParams) -> u32 {
    let seqs = params.llama_n_seq_max();
    let n_batch = params.n_batch.min(params.n_ctx).max(seqs);
    if !params.embeddings {
        return n_batch;
    }
    let up = n_batch.div_ceil(seqs).saturating_mul(seqs);
    if up <= params.n_ctx {
        up
    } else {
        n_batch / seqs * seqs // >= seqs: n_batch >= n_seq_max
    }
}

/// Refuse a KV cache the machine cannot hold before llama.cpp tries to
/// allocate it (`n_ctx=10**9` used to allocate gigabytes, then fail with
/// "null reference"). Only for a KV cache in host memory: a GPU build that
/// offloads layers keeps it in device memory, where llama.cpp's own
/// allocation failure is a clean error.
fn check_memory(model: &Model, params: &ContextParams) -> Result<()> {
    let offloaded = params.n_gpu_layers != 0 && crate::backend::supports_gpu_offload();
    if offloaded {
        return Ok(());
    }
    // llama.cpp pads n_ctx to a multiple of 256 with unified KV.
    let cells = u64::from(params.n_ctx).div_ceil(256) * 256;
    let needed = model
        .kv_bytes_per_cell(params.type_k, params.type_v)
        .saturating_mul(cells);
    match crate::sysmem::available_bytes() {
        Some(free) if needed > free => Err(Error::OutOfMemory(format!(
            "a KV cache of n_ctx={} cells needs {} ({} per cell) but only {} of memory is available; \
             lower n_ctx or use a quantised type_k/type_v",
            params.n_ctx,
            crate::sysmem::human(needed),
            crate::sysmem::human(model.kv_bytes_per_cell(params.type_k, params.type_v)),
            crate::sysmem::human(free),
        ))),
        _ => Ok(()),
    }
}

fn create_llama_context<'m>(model: &'m Model, params: &ContextParams) -> Result<LlamaContext<'m>> {
    let threads = i32::try_from(params.effective_threads()).unwrap_or(1);
    let cparams = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(params.n_ctx))
        .with_n_batch(params.n_batch)
        .with_n_ubatch(params.n_batch)
        .with_n_seq_max(params.llama_n_seq_max())
        .with_n_threads(threads)
        .with_n_threads_batch(threads)
        .with_embeddings(params.embeddings)
        .with_pooling_type(if params.pools_in_rust() {
            crate::params::Pooling::None.to_llama()
        } else {
            params.pooling.to_llama()
        })
        .with_type_k(params.type_k.to_llama())
        .with_type_v(params.type_v.to_llama())
        // One KV pool for every sequence, so forks share their prefix cells.
        .with_kv_unified(true)
        // Sliding-window layers keep every cell, so sequences can be copied
        // and trimmed at any position (Gemma 3 and other SWA models).
        .with_swa_full(true);
    let backend = backend()?;
    let _guard = lock(&CONTEXT_CREATION);
    model.llama.new_context(backend, cparams).map_err(|e| {
        Error::ContextCreate(format!(
            "{e} (n_ctx={}, n_batch={})",
            params.n_ctx, params.n_batch
        ))
    })
}

type Deferred = Box<dyn FnOnce() + Send>;

thread_local! {
    /// What the job that just panicked on this worker said, for the
    /// replies it dropped (see `Reply`'s `Drop`).
    static PANIC: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
    /// Replies deferred by [`after_job`] while the worker runs a job.
    static AFTER_JOB: std::cell::RefCell<Option<Vec<Deferred>>> =
        const { std::cell::RefCell::new(None) };
}

/// Run `f` once the job the worker thread is running has finished and the
/// worker is free again; at once on any other thread. Reply callbacks use
/// this so that whoever a reply wakes finds the worker idle (and can run
/// short work inline) instead of racing its last steps. Replies still run
/// in the order they were given.
pub fn after_job(f: Deferred) {
    let now = AFTER_JOB.with(|q| match q.borrow_mut().as_mut() {
        Some(queue) => {
            queue.push(f);
            None
        }
        None => Some(f),
    });
    if let Some(f) = now {
        f();
    }
}

/// The worker thread's loop: run jobs in order, each holding the worker.
fn run(engine: &Engine, rx: &Receiver<Job>) {
    let mut pending = Vec::new();
    // Replies deferred during a job; the buffer is reused from job to job.
    let mut replies: Vec<Deferred> = Vec::new();
    while let Ok(first) = rx.recv() {
        pending.push(first);
        pending.extend(rx.try_iter());
        for (job, merged) in crate::store::merge_commits(pending.drain(..)) {
            let mut guard = lock(&engine.worker);
            if let Some(w) = guard.as_mut() {
                w.finish_background();
            }
            if let Job::Close { reply } = job {
                for rest in rx.try_iter() {
                    rest.fail(Error::ContextClosed);
                }
                // Free every branch's state and the llama.cpp context here,
                // on the thread that used them, then give the memory back.
                if let Some(w) = guard.as_ref() {
                    let states = lock(&w.shared.branches).take_all();
                    drop(states);
                }
                drop(guard.take());
                drop(guard);
                crate::sysmem::release_free_memory();
                reply.send(Ok(()));
                return;
            }
            AFTER_JOB.with(|q| *q.borrow_mut() = Some(std::mem::take(&mut replies)));
            match guard.as_mut() {
                Some(w) if !w.shared.closed.load(Ordering::Acquire) => {
                    let busy = match &job {
                        Job::Branch(b) => b.busy_ids(),
                        _ => Vec::new(),
                    };
                    // A job that panics has answered its caller (its reply
                    // was dropped unsent: see `Reply`); free its branches
                    // and go on with the next job on this thread.
                    if let Err(payload) = catch_unwind(AssertUnwindSafe(|| w.execute(job))) {
                        let message = match Error::from_panic(payload) {
                            Error::Internal(m) => m,
                            other => other.to_string(),
                        };
                        PANIC.with(|p| *p.borrow_mut() = Some(message));
                        crate::store::clear_busy(&mut lock(&w.shared.branches), busy);
                    }
                }
                _ => job.fail(Error::ContextClosed),
            }
            drop(guard);
            engine.queued.fetch_sub(merged, Ordering::SeqCst);
            replies = AFTER_JOB
                .with(|q| q.borrow_mut().take())
                .unwrap_or_default();
            for reply in replies.drain(..) {
                reply();
            }
            PANIC.with(|p| p.borrow_mut().take());
        }
    }
    let mut guard = lock(&engine.worker);
    if let Some(w) = guard.as_mut() {
        w.finish_background();
    }
    drop(guard.take());
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
        let threads = self.params.effective_threads();
        self.background = Some(crate::omp::Background::start(0, threads, Box::new(|_| {})));
    }

    fn execute(&mut self, job: Job) {
        #[cfg(feature = "testing")]
        if self.shared.panic_next.swap(false, Ordering::SeqCst) {
            panic!("injected by Context::panic_next_job");
        }
        match job {
            Job::Decode {
                tokens,
                pos,
                seq,
                reply,
            } => {
                let result = self.decode(&tokens, pos, seq);
                reply.send(result);
            }
            Job::Branch(job) => self.execute_branch(job),
            Job::Kv(job) => self.execute_kv(job),
            Job::Embed(job) => self.execute_embed(job),
            Job::Hold { until } => {
                // Returns when the `WorkerHold` is dropped (disconnected).
                let _ = until.recv();
            }
            Job::Close { .. } => unreachable!("handled by run"),
        }
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

    /// One `llama_decode` of the current batch, counted in the stats. With
    /// tombstones, a full cache frees them and tries once more.
    pub(crate) fn llama_decode(&mut self, n_tokens: usize) -> Result<()> {
        self.finish_background();
        DECODED.store(true, Ordering::Relaxed);
        let started = Instant::now();
        let mut result = self.ctx.decode(&mut self.batch);
        if let (Err(DecodeError::NoKvCacheSlot), Some(tomb)) = (&result, self.tomb()) {
            if self.ctx.kv_cache_seq_pos_max(tomb) >= 0 {
                let _ = self.ctx.kv_cache_seq_rm(tomb, None, None);
                self.shared
                    .stats
                    .tombstone_purges
                    .fetch_add(1, Ordering::Relaxed);
                result = self.ctx.decode(&mut self.batch);
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn params(n_ctx: u32, n_batch: u32, n_seq_max: u32, embeddings: bool) -> ContextParams {
        ContextParams {
            n_ctx,
            n_batch,
            n_seq_max,
            embeddings,
            ..ContextParams::default()
        }
    }

    #[test]
    fn n_batch_never_exceeds_n_ctx() {
        assert_eq!(effective_n_batch(&params(256, 512, 1, false)), 256);
        assert_eq!(
            effective_n_batch(&params(256, 1_000_000_000, 1, false)),
            256
        );
        assert_eq!(effective_n_batch(&params(2048, 512, 4, false)), 512);
        // At least one output row per sequence (llama.cpp asserts).
        assert_eq!(effective_n_batch(&params(256, 2, 4, false)), 4);
        assert_eq!(effective_n_batch(&params(42, 512, 42, false)), 42);
    }

    #[test]
    fn embedding_n_batch_is_a_multiple_of_n_seq_max_within_n_ctx() {
        // Rounded up while that fits, down otherwise.
        assert_eq!(effective_n_batch(&params(2048, 512, 3, true)), 513);
        assert_eq!(effective_n_batch(&params(256, 256, 3, true)), 255);
        assert_eq!(effective_n_batch(&params(256, 512, 8, true)), 256);
        assert_eq!(effective_n_batch(&params(42, 1_000_000_000, 41, true)), 41);
        assert_eq!(effective_n_batch(&params(256, 2, 4, true)), 4);
    }
}
