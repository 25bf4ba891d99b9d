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

/// The initialised llama.cpp backend, shared by every context. llama-cpp-2
/// allows one initialisation per process, so Rust code that creates its own
/// llama-cpp-2 models or contexts beside lloyal's takes this one.
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
            #[cfg(feature = "dynamic-backends")]
            modules::load()?;
            LlamaBackend::init().map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::Internal(format!("llama.cpp backend init failed: {e}")))
}

/// With the `dynamic-backends` feature llama.cpp's compute backends (the CPU
/// variants, CUDA, ...) are shared modules (`libggml-<name>[-<variant>].so`)
/// that must be loaded before the backend is initialised. They are looked for
/// in `LLOYAL_BACKEND_DIR` if set, else next to the shared library this code
/// is linked into (the Python extension: the wheel ships them beside it),
/// else in the directory the build left them in (`cargo test`).
#[cfg(feature = "dynamic-backends")]
mod modules {
    use std::ffi::{CStr, OsStr, OsString};
    use std::os::unix::ffi::OsStrExt;
    use std::path::{Path, PathBuf};

    pub(super) fn load() -> Result<(), String> {
        let candidates: Vec<PathBuf> = std::env::var_os("LLOYAL_BACKEND_DIR")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .into_iter()
            .chain(own_dir())
            .chain(llama_cpp_sys_2::BACKENDS_DIR.map(PathBuf::from))
            .collect();
        let Some(dir) = candidates.iter().find(|d| has_cpu_module(d)) else {
            return Err(format!(
                "no llama.cpp CPU backend module (libggml-cpu*.so) in {candidates:?}; \
                 set LLOYAL_BACKEND_DIR to the directory that holds them"
            ));
        };
        // `load_backends_from_path` panics on a non-UTF-8 path: refuse it here.
        if dir.to_str().is_none() {
            return Err(format!("backend directory {dir:?} is not valid UTF-8"));
        }
        llama_cpp_2::llama_backend::load_backends_from_path(dir);
        if llama_cpp_2::list_llama_ggml_backend_devices().is_empty() {
            return Err(format!(
                "no llama.cpp backend device could be loaded from {dir:?}"
            ));
        }
        Ok(())
    }

    fn has_cpu_module(dir: &Path) -> bool {
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.flatten().any(|e| {
                let name: OsString = e.file_name();
                let name = name.as_bytes();
                name.starts_with(b"libggml-cpu") && name.ends_with(b".so")
            })
        })
    }

    /// The directory of the shared object (or executable) holding this code.
    fn own_dir() -> Option<PathBuf> {
        // SAFETY: `Dl_info` is plain data (pointers and integers), for which
        // all-zero is a valid value.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        let addr = own_dir as fn() -> Option<PathBuf> as *const libc::c_void;
        // SAFETY: dladdr only inspects the address and writes into `info`;
        // on success `dli_fname` is a NUL-terminated string owned by the
        // loader that lives as long as the object is loaded (this code's).
        let found = unsafe { libc::dladdr(addr, &mut info) };
        if found == 0 || info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: checked non-null above; see dladdr's contract.
        let file = unsafe { CStr::from_ptr(info.dli_fname) };
        let path = Path::new(OsStr::from_bytes(file.to_bytes()));
        path.parent().map(Path::to_path_buf)
    }
}

/// Whether this build of llama.cpp can offload layers to a GPU.
pub fn supports_gpu_offload() -> bool {
    backend().is_ok_and(LlamaBackend::supports_gpu_offload)
}
