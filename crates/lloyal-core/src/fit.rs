//! `n_gpu_layers = auto`: how many layers go to the GPU, chosen by
//! llama.cpp's own parameter fitting (`common_fit_params`, what
//! `llama-server --fit` runs). It measures the model, the KV cache and the
//! compute buffers the context will have (a load with no allocation) against
//! each device's free memory less a margin, and offloads as many layers as
//! fit. On a build or machine with no GPU it costs nothing and offloads none.
//!
//! Only the layer count is taken from the fit: with several GPUs llama.cpp
//! also chooses a split, and for mixture-of-experts models it may keep
//! expert tensors on the CPU; lloyal loads with llama.cpp's default split.

use std::path::Path;
use std::pin::pin;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::model::params::{FitError, LlamaModelParams};

use crate::backend::{backend, supports_gpu_offload, CONTEXT_CREATION};
use crate::error::{Error, Result};
use crate::params::{ContextParams, GpuLayers};
use crate::sync::lock;

/// What [`GpuLayers::Auto`] resolves to for this model and context: every
/// layer when everything fits, a count when only some do, none without a
/// GPU (or when not even the context's own buffers fit). Other values are
/// returned as they are.
///
/// The fit reads the model file (a load that allocates nothing), so it
/// takes a fraction of a load's time.
pub fn fit_gpu_layers(model_path: &Path, params: &ContextParams) -> Result<GpuLayers> {
    if params.n_gpu_layers != GpuLayers::Auto {
        return Ok(params.n_gpu_layers);
    }
    if !supports_gpu_offload() {
        return Ok(GpuLayers::Count(0));
    }
    backend()?;
    // A path that is not UTF-8 cannot be handed to the fit (it takes a C
    // string); the load itself copes (`Model::load`). Offload everything,
    // llama.cpp's own default.
    let Some(c_path) = model_path
        .to_str()
        .and_then(|p| std::ffi::CString::new(p).ok())
    else {
        return Ok(GpuLayers::All);
    };
    let mut cparams = llama_context_params(params);
    let mut mparams = pin!(LlamaModelParams::default());
    // SAFETY: a plain C call with no arguments.
    let devices = unsafe { llama_cpp_sys_2::llama_max_devices() };
    let margin = usize::try_from(params.fit_margin).unwrap_or(usize::MAX);
    let mut margins = vec![margin; devices.max(1)];
    // The fit swaps llama.cpp's process-wide logger while it runs, and
    // creates (unallocated) contexts: one at a time, like context creation.
    let fitted = {
        let _guard = lock(&CONTEXT_CREATION);
        mparams.as_mut().fit_params(
            &c_path,
            &mut cparams,
            &mut margins,
            params.n_ctx,
            llama_cpp_sys_2::GGML_LOG_LEVEL_ERROR,
        )
    };
    match fitted {
        Ok(_) => Ok(match mparams.n_gpu_layers() {
            n if n < 0 => GpuLayers::All,
            n => GpuLayers::Count(n.unsigned_abs()),
        }),
        Err(FitError::Failure) => Ok(GpuLayers::Count(0)),
        Err(e) => Err(Error::ModelLoad {
            path: model_path.to_path_buf(),
            reason: format!("llama.cpp could not measure the model for n_gpu_layers=auto: {e}"),
        }),
    }
}

/// `params` with [`GpuLayers::Auto`] resolved by [`fit_gpu_layers`].
pub(crate) fn resolved(model_path: &Path, params: ContextParams) -> Result<ContextParams> {
    let n_gpu_layers = fit_gpu_layers(model_path, &params)?;
    Ok(ContextParams {
        n_gpu_layers,
        ..params
    })
}

/// The llama.cpp context parameters of a lloyal context: the context that is
/// created and the one the fit measures are the same.
pub(crate) fn llama_context_params(params: &ContextParams) -> LlamaContextParams {
    let threads = i32::try_from(params.effective_threads()).unwrap_or(1);
    LlamaContextParams::default()
        .with_n_ctx(std::num::NonZeroU32::new(params.n_ctx))
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
        .with_swa_full(true)
}
