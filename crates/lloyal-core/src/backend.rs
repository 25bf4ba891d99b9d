//! Process-wide llama.cpp state: the backend is initialised once, and its
//! log output is silenced unless `LLOYAL_LOG` is set (llama.cpp otherwise
//! prints hundreds of lines per model load to stderr).

use std::sync::{Mutex, OnceLock};

use llama_cpp_2::llama_backend::LlamaBackend;

use crate::error::{Error, Result};

static BACKEND: OnceLock<std::result::Result<LlamaBackend, String>> = OnceLock::new();

/// llama.cpp mutates model state while creating a context, so contexts are
/// created one at a time (see `LlamaModel::new_context`'s FIXME upstream).
pub(crate) static CONTEXT_CREATION: Mutex<()> = Mutex::new(());

/// The initialised llama.cpp backend.
pub fn backend() -> Result<&'static LlamaBackend> {
    BACKEND
        .get_or_init(|| {
            // Without the redirect llama.cpp writes its own log to stderr,
            // which is what a user debugging a model load wants.
            let verbose = std::env::var_os("LLOYAL_LOG").is_some_and(|v| !v.is_empty() && v != "0");
            if !verbose {
                llama_cpp_2::send_logs_to_tracing(
                    llama_cpp_2::LogOptions::default().with_logs_enabled(false),
                );
            }
            LlamaBackend::init().map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::Internal(format!("llama.cpp backend init failed: {e}")))
}

/// Whether this build of llama.cpp can offload layers to a GPU.
pub fn supports_gpu_offload() -> bool {
    backend().is_ok_and(LlamaBackend::supports_gpu_offload)
}
