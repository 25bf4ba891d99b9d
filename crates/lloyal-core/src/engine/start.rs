//! Opening a context: the model, the llama.cpp context and the worker
//! thread that owns them.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_batch::LlamaBatch;

use super::handle::{Closer, Context, OPEN, WORKERS, WORKER_THREAD_NAME};
use super::reply::Reply;
use super::run::run;
use super::shared::{Shared, StatCounters};
use super::worker::{Engine, Worker, DECODED};
use crate::backend::{backend, CONTEXT_CREATION};
use crate::error::{invalid, Error, Result};
use crate::model::Model;
use crate::params::ContextParams;
use crate::sync::lock;

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
            set_for_c(VAR, "0");
            Ok(())
        }
        Err(_) => Err(invalid(format!(
            "deterministic=True must be set up before this process decodes anything: \
             llama.cpp reads {VAR} once per process. Open the deterministic context first, \
             or start the process with {VAR}=0"
        ))),
    }
}

/// Set an environment variable that llama.cpp reads with C's `getenv`. On
/// Windows the C runtime keeps a copy of the environment of its own, which
/// `SetEnvironmentVariableW` (Rust's `set_var`) leaves as it was, so the
/// runtime's copy is set too (`_putenv_s`: the msvcrt.dll that MinGW's
/// llama.cpp imports, or the static runtime an MSVC build links in beside
/// it); without it the deterministic mode was silently off on Windows.
fn set_for_c(name: &str, value: &str) {
    std::env::set_var(name, value);
    #[cfg(windows)]
    {
        use std::ffi::{c_char, c_int, CString};
        extern "C" {
            fn _putenv_s(name: *const c_char, value: *const c_char) -> c_int;
        }
        if let (Ok(n), Ok(v)) = (CString::new(name), CString::new(value)) {
            // SAFETY: two NUL-terminated strings that outlive the call; the
            // runtime copies them.
            unsafe {
                _putenv_s(n.as_ptr(), v.as_ptr());
            }
        }
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
}

fn worker_main(model_path: PathBuf, params: ContextParams, on_ready: &mut Option<Reply<Context>>) {
    let loaded = crate::fit::resolved(&model_path, params).and_then(|params| {
        Model::load(
            &model_path,
            params.n_gpu_layers.to_llama(),
            !params.deterministic,
        )
        .map(|model| (model, params))
    });
    let (model, params) = match loaded {
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
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let weak_sender = tx.downgrade();
    let shared = Arc::new(Shared {
        closed: AtomicBool::new(false),
        stats: StatCounters::default(),
        pos_max: (0..params.n_seq_max).map(|_| AtomicI32::new(-1)).collect(),
        logits: Mutex::new(None),
        sampler: Mutex::new(None),
        branches: Mutex::new(crate::state::Branches::new(params.n_seq_max)),
        default_adapters: Mutex::new(Default::default()),
        embeddings: Mutex::new(None),
        step_tokens: AtomicUsize::new(0),
        threads: AtomicUsize::new(0),
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
    let cpu = (!params.n_gpu_layers.offloads() || !crate::backend::supports_gpu_offload())
        .then(crate::omp::CpuContext::open);
    // Opened here, on the worker thread: it reads this thread's statistics.
    // Not in the deterministic mode: a thread count is part of a route
    // (the split-KV attention of one token merges per-thread results).
    // And only with the C context at hand: the count is set through it.
    let raw_ctx = crate::adapter::context_pointer(&ctx);
    let threads = crate::threads::Threads::new(
        params.effective_threads(),
        params.n_threads.is_none() && cpu.is_some() && !params.deterministic && raw_ctx.is_some(),
    );
    shared
        .threads
        .store(threads.now() as usize, Ordering::Relaxed);
    let worker = Worker {
        background: None,
        threads,
        raw_ctx,
        adapters: Default::default(),
        mtmd: None,
        ctx,
        model: Arc::clone(&model),
        // A token may belong to every sequence (a shared prefix of a
        // token tree, `branch_prefill_tree`).
        batch: LlamaBatch::new(n_batch, params.n_seq_max as i32),
        n_batch,
        cpu,
        params,
        shared,
        logit_pool: Vec::new(),
    };
    *lock(&engine.worker) = Some(worker);
    {
        let mut open = lock(&OPEN);
        open.retain(|c| c.sender.strong_count() > 0);
        open.push(Closer {
            sender: weak_sender,
            shared: Arc::downgrade(&handle.shared),
        });
    }
    if let Some(ready) = on_ready.take() {
        ready.send(Ok(handle));
    }
    run(&engine, &mut rx);
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
    let offloaded = params.n_gpu_layers.offloads() && crate::backend::supports_gpu_offload();
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
    let cparams = crate::fit::llama_context_params(params);
    let backend = backend()?;
    let _guard = lock(&CONTEXT_CREATION);
    model.llama.new_context(backend, cparams).map_err(|e| {
        Error::ContextCreate(format!(
            "{e} (n_ctx={}, n_batch={})",
            params.n_ctx, params.n_batch
        ))
    })
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
