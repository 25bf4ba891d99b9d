//! # lloyal-core
//!
//! The engine behind the `lloyal` Python package: llama.cpp (through
//! `llama-cpp-2`) driven by one worker thread per context, with sampling,
//! entropy and perplexity computed in Rust on copies of the logits.
//!
//! ```no_run
//! use lloyal_core::{Context, ContextParams, SamplingParams, Sampler};
//!
//! let ctx = Context::open_blocking("model.gguf", ContextParams::default())?;
//! let prompt = ctx.model().tokenize("The capital of France is", None, false)?;
//! ctx.decode_blocking(prompt.clone(), 0, 0)?;
//! let mut sampler = Sampler::new(SamplingParams::greedy())?;
//! let next = sampler.sample(&ctx.logits()?)?;
//! println!("{}", ctx.model().detokenize(&[next], false)?);
//! ctx.close_blocking();
//! # Ok::<(), lloyal_core::Error>(())
//! ```
//!
//! The same engine from async Rust ([`Context::aio`]): four branches forked
//! from one prompt, each committed from its own task; the worker merges
//! the commits queued meanwhile into one decode. (`make test-rust` runs it
//! with `LLOYAL_TEST_MODEL` set to SmolLM2.)
//!
//! ```
//! use std::sync::Arc;
//!
//! use lloyal_core::{Context, ContextParams, SamplingParams};
//!
//! #[tokio::main]
//! async fn main() -> lloyal_core::Result<()> {
//!     let params = ContextParams { n_seq_max: 5, ..ContextParams::default() };
//!     let path = std::env::var("LLOYAL_TEST_MODEL").unwrap_or_else(|_| "model.gguf".into());
//!     let ctx = Arc::new(Context::open_blocking(path, params)?);
//!     let prompt = ctx.model().tokenize("Once upon a time", None, false)?;
//!     let root = ctx.branch_create(SamplingParams::greedy())?;
//!     ctx.aio().prefill(vec![(root, prompt)], false).await?;
//!     let mut tasks = Vec::new();
//!     for _ in 0..4 {
//!         let kid = ctx.aio().fork(root).await?;
//!         let ctx = Arc::clone(&ctx);
//!         tasks.push(tokio::spawn(async move {
//!             let token = ctx.aio().produce(kid).await?;
//!             ctx.aio().commit(vec![(kid, token)]).await
//!         }));
//!     }
//!     for task in tasks {
//!         task.await.expect("the task ran")?;
//!     }
//!     ctx.aio().close().await
//! }
//! ```

pub mod adapter;
pub mod aio;
mod backend;
pub mod branch;
pub mod chat;
pub mod embed;
pub mod engine;
pub mod error;
mod fit;
pub mod flat;
pub mod gbnf;
pub mod gguf;
pub mod grammar;
mod isolate;
mod kv;
pub mod media;
pub mod metrics;
pub mod model;
mod omp;
pub mod params;
pub mod sampling;
pub mod state;
mod sync;
mod sysmem;
mod threads;

/// Entry points of the parsers that read untrusted bytes, for the fuzz
/// targets (`tests/fuzz.rs`). Not part of the API.
#[doc(hidden)]
pub mod fuzzing {
    /// Check a framed KV state the way loading does, without a context:
    /// the frame (fingerprint `fingerprint`), then llama.cpp's payload
    /// against a context of `n_cells` cells.
    pub fn check_state(fingerprint: u64, data: &[u8], n_cells: u32) -> crate::Result<Vec<i32>> {
        let (tokens, payload) = crate::kv::decode(fingerprint, data)?;
        crate::kv::check_payload(payload, n_cells)?;
        Ok(tokens)
    }

    /// Frame `payload` as a saved state holding `tokens`.
    pub fn frame_state(fingerprint: u64, tokens: &[i32], payload: &[u8]) -> Vec<u8> {
        crate::kv::encode(fingerprint, tokens, payload)
    }

    /// The longest tag of a chat template, in tokens (its pre-check).
    pub fn template_tag_tokens(source: &str) -> usize {
        crate::chat::longest_tag(source)
    }
}

pub use adapter::{Adapters, ControlVector, Lora};
pub use backend::{
    backend, backend_info, supports_gpu_offload, BackendInfo, Device, LLAMA_CPP_2_VERSION,
};
pub use branch::{Branch, TreeOutcome};
pub use engine::{
    after_job, join_workers, Context, Embeddings, Hold, ItemResults, Reply, Stats, StepGroup,
    StepInput, WORKER_THREAD_NAME,
};
pub use error::{Error, Result};
pub use fit::fit_gpu_layers;
pub use grammar::{json_schema_to_grammar, Grammar, GrammarSpec};
pub use metrics::{Base, PerplexityTracker};
pub use model::{FimTokens, Model, ModelInfo};
pub use params::{ContextParams, KvType, Pooling};
pub use sampling::{Sampler, SamplingParams};
pub use state::{BranchId, BranchState, Branches, LogitsView};
