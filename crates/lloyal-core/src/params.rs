//! Context creation parameters, validated before llama.cpp sees them.

use llama_cpp_2::context::params::{KvCacheType, LlamaPoolingType};

use crate::error::{invalid, Result};

/// The most sequences (KV leases) llama.cpp supports in one context.
pub const MAX_SEQUENCES: u32 = 256;

/// How an embedding context pools token embeddings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    None,
    Mean,
    Cls,
    Last,
    Rank,
}

impl std::str::FromStr for Pooling {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "none" => Pooling::None,
            "mean" => Pooling::Mean,
            "cls" => Pooling::Cls,
            "last" => Pooling::Last,
            "rank" => Pooling::Rank,
            other => {
                return Err(invalid(format!(
                    "pooling must be one of none, mean, cls, last, rank; got {other:?}"
                )))
            }
        })
    }
}

impl Pooling {
    pub(crate) fn to_llama(self) -> LlamaPoolingType {
        match self {
            Pooling::None => LlamaPoolingType::None,
            Pooling::Mean => LlamaPoolingType::Mean,
            Pooling::Cls => LlamaPoolingType::Cls,
            Pooling::Last => LlamaPoolingType::Last,
            Pooling::Rank => LlamaPoolingType::Rank,
        }
    }
}

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Iq4Nl,
    Q5_0,
    Q5_1,
}

impl std::str::FromStr for KvType {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => KvType::F32,
            "f16" => KvType::F16,
            "bf16" => KvType::Bf16,
            "q8_0" => KvType::Q8_0,
            "q4_0" => KvType::Q4_0,
            "q4_1" => KvType::Q4_1,
            "iq4_nl" => KvType::Iq4Nl,
            "q5_0" => KvType::Q5_0,
            "q5_1" => KvType::Q5_1,
            other => {
                return Err(invalid(format!(
                    "KV cache type must be one of f32 f16 bf16 q8_0 q4_0 q4_1 iq4_nl q5_0 q5_1; got {other:?}"
                )))
            }
        })
    }
}

impl KvType {
    pub(crate) fn to_llama(self) -> KvCacheType {
        match self {
            KvType::F32 => KvCacheType::F32,
            KvType::F16 => KvCacheType::F16,
            KvType::Bf16 => KvCacheType::BF16,
            KvType::Q8_0 => KvCacheType::Q8_0,
            KvType::Q4_0 => KvCacheType::Q4_0,
            KvType::Q4_1 => KvCacheType::Q4_1,
            KvType::Iq4Nl => KvCacheType::IQ4_NL,
            KvType::Q5_0 => KvCacheType::Q5_0,
            KvType::Q5_1 => KvCacheType::Q5_1,
        }
    }

    /// The cache type when none is asked for: f16, or q8_0 in the
    /// deterministic mode (which needs a quantized cache).
    pub fn default_for(deterministic: bool) -> Self {
        if deterministic {
            KvType::Q8_0
        } else {
            KvType::F16
        }
    }

    /// Quantized cells (not f32/f16/bf16).
    pub fn is_quantized(self) -> bool {
        !matches!(self, KvType::F32 | KvType::F16 | KvType::Bf16)
    }

    /// The name `FromStr` takes.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Bf16 => "bf16",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
            KvType::Q4_1 => "q4_1",
            KvType::Iq4Nl => "iq4_nl",
            KvType::Q5_0 => "q5_0",
            KvType::Q5_1 => "q5_1",
        }
    }

    /// Bytes per element (block size amortised for quantised types).
    pub(crate) fn bytes_per_element(self) -> f64 {
        match self {
            KvType::F32 => 4.0,
            KvType::F16 | KvType::Bf16 => 2.0,
            KvType::Q8_0 => 34.0 / 32.0,
            KvType::Q4_0 | KvType::Iq4Nl => 18.0 / 32.0,
            KvType::Q4_1 => 20.0 / 32.0,
            KvType::Q5_0 => 22.0 / 32.0,
            KvType::Q5_1 => 24.0 / 32.0,
        }
    }
}

/// The most threads llama.cpp's CPU backend can use (`GGML_MAX_N_THREADS`).
pub const MAX_THREADS: u32 = 512;

/// The largest `n_ctx` accepted: positions are `i32` in llama.cpp, which
/// also pads `n_ctx` up in 32-bit arithmetic. Memory runs out long before.
pub const MAX_N_CTX: u32 = 1 << 30;

/// The margin [`GpuLayers::Auto`] leaves free on each device by default:
/// llama.cpp's own default for `--fit-target` (1 GiB).
pub const DEFAULT_FIT_MARGIN: u64 = 1 << 30;

/// How many of a model's layers are offloaded to the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuLayers {
    /// As many as fit the free memory of the devices, with the context's
    /// KV cache and compute buffers counted, as llama.cpp's `--fit` chooses
    /// them (`crate::fit`). No GPU: none, at no cost.
    #[default]
    Auto,
    /// Every layer the build can offload (none on a CPU-only build).
    All,
    /// This many layers (the last ones; `0` offloads none).
    Count(u32),
}

impl GpuLayers {
    /// llama.cpp's `n_gpu_layers` for a resolved value: `-1` for every
    /// layer. `Auto` must be resolved first (`crate::fit`); it maps to `-1`,
    /// llama.cpp's own default.
    pub fn to_llama(self) -> i32 {
        match self {
            GpuLayers::Auto | GpuLayers::All => -1,
            GpuLayers::Count(n) => i32::try_from(n).unwrap_or(i32::MAX),
        }
    }

    /// Whether any layer may go to a GPU.
    pub fn offloads(self) -> bool {
        self != GpuLayers::Count(0)
    }
}

/// Everything `create_context` accepts.
#[derive(Debug, Clone, PartialEq)]
pub struct ContextParams {
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_seq_max: u32,
    /// `None` uses `LLOYAL_THREADS` if set, else every core the process
    /// may run on ([`Self::effective_threads`]).
    pub n_threads: Option<u32>,
    pub embeddings: bool,
    pub pooling: Pooling,
    pub type_k: KvType,
    pub type_v: KvType,
    /// How many layers go to the GPU: fitted to free device memory by
    /// llama.cpp ([`GpuLayers::Auto`], the default), every layer, or a count.
    pub n_gpu_layers: GpuLayers,
    /// With [`GpuLayers::Auto`]: bytes to leave free on each device (llama.cpp's
    /// `--fit-target`; 1 GiB by default).
    pub fit_margin: u64,
    /// Batch-invariant logits on the CPU backend (docs/determinism.md):
    /// weights in file layout (no repacking), K-quant matmuls on the
    /// dot-product path (`GGML_CPU_TILED_MM=0`, process-wide) and a
    /// quantized KV cache (one flash-attention kernel, f32 accumulation).
    pub deterministic: bool,
}

impl Default for ContextParams {
    fn default() -> Self {
        Self {
            n_ctx: 2048,
            n_batch: 512,
            n_seq_max: 1,
            n_threads: None,
            embeddings: false,
            pooling: Pooling::Mean,
            type_k: KvType::F16,
            type_v: KvType::F16,
            n_gpu_layers: GpuLayers::Auto,
            fit_margin: DEFAULT_FIT_MARGIN,
            deterministic: false,
        }
    }
}

impl ContextParams {
    pub fn validate(&self) -> Result<()> {
        if !(8..=MAX_N_CTX).contains(&self.n_ctx) {
            return Err(invalid(format!(
                "n_ctx must be in [8, {MAX_N_CTX}], got {}",
                self.n_ctx
            )));
        }
        if self.n_batch == 0 {
            return Err(invalid("n_batch must be >= 1"));
        }
        let most = MAX_SEQUENCES - u32::from(self.tombstones());
        if self.n_seq_max == 0 || self.n_seq_max > most {
            let why = if self.tombstones() {
                " (deterministic=True keeps one sequence for itself)"
            } else {
                ""
            };
            return Err(invalid(format!(
                "n_seq_max must be in [1, {most}]{why}, got {}",
                self.n_seq_max
            )));
        }
        if self.llama_n_seq_max() > self.n_ctx {
            // llama.cpp reserves an output row per sequence within
            // n_batch <= n_ctx, and aborts when they do not fit.
            return Err(invalid(format!(
                "n_seq_max ({}) must be <= n_ctx ({})",
                self.n_seq_max, self.n_ctx
            )));
        }
        if let Some(n) = self.n_threads {
            // llama.cpp's own limit (GGML_MAX_N_THREADS): past it, it
            // still starts every thread, and each decode crawls.
            if !(1..=MAX_THREADS).contains(&n) {
                return Err(invalid(format!(
                    "n_threads must be in [1, {MAX_THREADS}] (or None for every core), got {n}"
                )));
            }
        }
        if self.deterministic && !(self.type_k.is_quantized() && self.type_v.is_quantized()) {
            return Err(invalid(format!(
                "deterministic=True needs a quantized KV cache (type_k and type_v such as \
                 \"q8_0\"): with f16/f32/bf16 cells llama.cpp's flash attention picks its kernel \
                 by batch size; got type_k={}, type_v={}",
                self.type_k.name(),
                self.type_v.name()
            )));
        }
        Ok(())
    }

    /// Whether removed KV cells go to a tombstone sequence instead of
    /// being freed (see `Worker::remove_cells`): the deterministic mode's,
    /// for contexts that decode branches (not embeddings).
    pub(crate) fn tombstones(&self) -> bool {
        self.deterministic && !self.embeddings
    }

    /// The sequences llama.cpp is asked for: `n_seq_max`, and the
    /// tombstone sequence (id `n_seq_max`) when there is one.
    pub(crate) fn llama_n_seq_max(&self) -> u32 {
        self.n_seq_max + u32::from(self.tombstones())
    }

    /// Mean pooling done by lloyal from the token rows, in a fixed order,
    /// instead of by llama.cpp (a matmul over the whole batch, whose sums
    /// change with the other inputs in it): the deterministic mode's.
    pub(crate) fn pools_in_rust(&self) -> bool {
        self.deterministic && self.embeddings && self.pooling == Pooling::Mean
    }

    /// The thread count used when `n_threads` is `None`: `LLOYAL_THREADS`
    /// when it holds a count in `[1, MAX_THREADS]` (a machine-wide default
    /// that needs no code change, as `OMP_NUM_THREADS` is for OpenMP
    /// programs), else every core.
    pub fn effective_threads(&self) -> u32 {
        self.n_threads.or_else(threads_from_env).unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| u32::try_from(n.get()).unwrap_or(1))
                .unwrap_or(1)
        })
    }
}

/// `LLOYAL_THREADS`, if set to a count in `[1, MAX_THREADS]` (anything
/// else is ignored, as an unset variable is).
fn threads_from_env() -> Option<u32> {
    let n: u32 = std::env::var("LLOYAL_THREADS").ok()?.trim().parse().ok()?;
    (1..=MAX_THREADS).contains(&n).then_some(n)
}
