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

    /// The CPU module llama.cpp picked, found among the objects loaded into
    /// this process (`libggml-cpu-<variant>.so`), and its directory.
    pub(super) fn loaded_cpu_module() -> (Option<String>, Option<PathBuf>) {
        let mut found: Option<PathBuf> = None;
        unsafe extern "C" fn visit(
            info: *mut libc::dl_phdr_info,
            _size: libc::size_t,
            data: *mut libc::c_void,
        ) -> libc::c_int {
            // SAFETY: dl_iterate_phdr passes a valid `dl_phdr_info` for each
            // loaded object, and `data` is the `&mut Option<PathBuf>` below.
            let (info, found) = unsafe { (&*info, &mut *data.cast::<Option<PathBuf>>()) };
            if info.dlpi_name.is_null() {
                return 0;
            }
            // SAFETY: non-null, a NUL-terminated path owned by the loader.
            let name = unsafe { CStr::from_ptr(info.dlpi_name) };
            let path = Path::new(OsStr::from_bytes(name.to_bytes()));
            let is_cpu = path.file_name().is_some_and(|f| {
                let f = f.as_bytes();
                f.starts_with(b"libggml-cpu") && f.ends_with(b".so")
            });
            if is_cpu {
                *found = Some(path.to_path_buf());
                return 1; // stop
            }
            0
        }
        // SAFETY: `visit` only reads what the loader hands it and writes
        // through `data`, which points at `found` for the whole call.
        unsafe {
            libc::dl_iterate_phdr(Some(visit), (&raw mut found).cast());
        }
        let Some(path) = found else {
            return (None, None);
        };
        let variant = path
            .file_name()
            .and_then(|f| f.to_str())
            .and_then(|f| f.strip_prefix("libggml-cpu-"))
            .and_then(|f| f.strip_suffix(".so"))
            .map(str::to_owned);
        (variant, path.parent().map(Path::to_path_buf))
    }
}

/// Whether this build of llama.cpp can offload layers to a GPU.
pub fn supports_gpu_offload() -> bool {
    backend().is_ok_and(LlamaBackend::supports_gpu_offload)
}

/// The llama-cpp-2 release this crate is built against (pinned exactly in
/// the workspace; it vendors llama.cpp, so it names the llama.cpp build).
/// `tests::pinned_version_matches_the_workspace` keeps the two in step.
pub const LLAMA_CPP_2_VERSION: &str = "0.1.160";

/// One compute device llama.cpp found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// The device's name, e.g. `"CPU"` or `"CUDA0"`.
    pub name: String,
    /// What the backend says it is, e.g. the CPU or GPU model.
    pub description: String,
    /// The backend that drives it: `"CPU"`, `"CUDA"`, `"Metal"`, ...
    pub backend: String,
    /// `"cpu"`, `"gpu"`, `"igpu"`, `"accel"` or `"unknown"`.
    pub kind: &'static str,
    /// Memory in bytes (0 where the backend does not say).
    pub memory_total: usize,
    /// Free memory in bytes at the time of the call.
    pub memory_free: usize,
}

/// How llama.cpp was built into this process and what it chose at run time.
#[derive(Debug, Clone)]
pub struct BackendInfo {
    /// [`LLAMA_CPP_2_VERSION`].
    pub llama_cpp_2_version: &'static str,
    /// `true` for the portable build: llama.cpp's compute backends are
    /// modules loaded at run time, one CPU module per x86-64 level (or ARM
    /// feature set), the best one for this CPU chosen by llama.cpp.
    /// `false` for a source build with llama.cpp linked in, compiled for the
    /// build machine's CPU.
    pub dynamic_backends: bool,
    /// The CPU module llama.cpp loaded, e.g. `"zen4"`, `"haswell"`,
    /// `"sse42"`, `"x64"` (`None` in a static build, and in a dynamic build
    /// whose CPU module carries no variant in its name).
    pub cpu_variant: Option<String>,
    /// Where the backend modules were loaded from (dynamic builds only).
    pub module_dir: Option<std::path::PathBuf>,
    /// llama.cpp's own summary of the CPU features it uses
    /// (`llama_print_system_info`), e.g. `"CPU : SSE3 = 1 | AVX2 = 1 | ..."`.
    pub system_info: String,
    /// The features the CPU backend's kernels use, from `system_info`'s CPU
    /// section: `["SSE3", "AVX2", "FMA", ...]`.
    pub cpu_features: Vec<String>,
    /// Every device llama.cpp found (the CPU always; GPUs where a GPU
    /// backend is built in or loaded).
    pub devices: Vec<Device>,
}

/// What llama.cpp this process runs. Initialises the backend if needed.
pub fn backend_info() -> Result<BackendInfo> {
    // Devices and CPU features are only known once backends are loaded.
    backend()?;
    // SAFETY: llama_print_system_info takes no arguments and returns a
    // pointer to a NUL-terminated string in a static buffer, valid until the
    // next call; it is copied at once, under a lock so that two threads do
    // not call it at the same time.
    let system_info = {
        static SYSTEM_INFO: Mutex<()> = Mutex::new(());
        let _guard = SYSTEM_INFO
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let ptr = unsafe { llama_cpp_sys_2::llama_print_system_info() };
        if ptr.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated (see above).
            unsafe { std::ffi::CStr::from_ptr(ptr) }
                .to_string_lossy()
                .trim()
                .to_owned()
        }
    };
    let devices = llama_cpp_2::list_llama_ggml_backend_devices()
        .into_iter()
        .map(|d| {
            use llama_cpp_2::LlamaBackendDeviceType as T;
            Device {
                name: d.name,
                description: d.description,
                backend: d.backend,
                kind: match d.device_type {
                    T::Cpu => "cpu",
                    T::Gpu => "gpu",
                    T::IntegratedGpu => "igpu",
                    T::Accelerator => "accel",
                    T::Unknown => "unknown",
                },
                memory_total: d.memory_total,
                memory_free: d.memory_free,
            }
        })
        .collect();
    #[cfg(feature = "dynamic-backends")]
    let (cpu_variant, module_dir) = modules::loaded_cpu_module();
    #[cfg(not(feature = "dynamic-backends"))]
    let (cpu_variant, module_dir) = (None, None);
    Ok(BackendInfo {
        llama_cpp_2_version: LLAMA_CPP_2_VERSION,
        dynamic_backends: cfg!(feature = "dynamic-backends"),
        cpu_variant,
        module_dir,
        cpu_features: cpu_features(&system_info),
        system_info,
        devices,
    })
}

/// The features that are on in the CPU section of llama.cpp's summary,
/// `"CPU : SSE3 = 1 | AVX = 1 | AMX_INT8 = 0 | ... |"` (other backends'
/// sections, `"CUDA : ..."`, follow after a `NAME :` of their own).
fn cpu_features(system_info: &str) -> Vec<String> {
    let Some((_, rest)) = system_info.split_once("CPU :") else {
        return Vec::new();
    };
    rest.split('|')
        .map(str::trim)
        .take_while(|item| !item.contains(':'))
        .filter_map(|item| item.split_once('='))
        .filter(|(_, on)| on.trim() != "0")
        .map(|(name, _)| name.trim().to_owned())
        .collect()
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_version_matches_the_workspace() {
        let manifest = include_str!("../../../Cargo.toml");
        let pin = format!("llama-cpp-2 = {{ version = \"={LLAMA_CPP_2_VERSION}\"");
        assert!(manifest.contains(&pin), "Cargo.toml does not pin {pin}");
    }

    #[test]
    fn cpu_features_come_from_the_cpu_section_only() {
        let info = "CPU : SSE3 = 1 | AVX = 1 | AMX_INT8 = 0 | OPENMP = 1 | CUDA : ARCHS = 900 |";
        assert_eq!(cpu_features(info), ["SSE3", "AVX", "OPENMP"]);
        assert!(cpu_features("").is_empty());
    }

    #[test]
    fn backend_info_names_the_cpu() {
        let info = backend_info().expect("backend");
        assert!(info.devices.iter().any(|d| d.kind == "cpu"), "{info:?}");
        assert!(info.system_info.contains("CPU"), "{info:?}");
        assert_eq!(
            info.dynamic_backends,
            info.cpu_variant.is_some() || info.module_dir.is_some()
        );
    }
}
