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
/// variants, CUDA, ...) are shared modules (`libggml-<name>[-<variant>].so`,
/// `ggml-<name>[-<variant>].dll` on Windows) that must be loaded before the
/// backend is initialised. They are looked for in `LLOYAL_BACKEND_DIR` if
/// set, else next to the shared library this code is linked into (the
/// Python extension: the wheel ships them beside it), else in the directory
/// the build left them in (`cargo test`).
#[cfg(feature = "dynamic-backends")]
mod modules {
    use std::path::{Path, PathBuf};

    #[cfg(unix)]
    use unix::{loaded_objects, own_dir};
    #[cfg(windows)]
    use windows::{loaded_objects, own_dir};

    /// What llama.cpp's loader names its CPU modules (ggml-backend-reg.cpp).
    const CPU_MODULE_PREFIX: &str = if cfg!(windows) {
        "ggml-cpu"
    } else {
        "libggml-cpu"
    };
    const MODULE_SUFFIX: &str = if cfg!(windows) { ".dll" } else { ".so" };

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
                "no llama.cpp CPU backend module ({CPU_MODULE_PREFIX}*{MODULE_SUFFIX}) in \
                 {candidates:?}; set LLOYAL_BACKEND_DIR to the directory that holds them"
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

    /// The variant of a CPU module's file name (`libggml-cpu-haswell.so`:
    /// `haswell`), `""` for a module without one; None for other files.
    fn cpu_variant(file: &Path) -> Option<&str> {
        let name = file.file_name()?.to_str()?;
        let rest = name
            .strip_prefix(CPU_MODULE_PREFIX)?
            .strip_suffix(MODULE_SUFFIX)?;
        match rest {
            "" => Some(""),
            _ => rest.strip_prefix('-'),
        }
    }

    fn has_cpu_module(dir: &Path) -> bool {
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| cpu_variant(Path::new(&e.file_name())).is_some())
        })
    }

    /// The CPU module llama.cpp picked, found among the objects loaded into
    /// this process, and its directory.
    pub(super) fn loaded_cpu_module() -> (Option<String>, Option<PathBuf>) {
        let Some(path) = loaded_objects()
            .into_iter()
            .find(|p| cpu_variant(p).is_some())
        else {
            return (None, None);
        };
        let variant = cpu_variant(&path)
            .filter(|v| !v.is_empty())
            .map(str::to_owned);
        (variant, path.parent().map(Path::to_path_buf))
    }

    #[cfg(unix)]
    mod unix {
        use std::ffi::{CStr, OsStr};
        use std::os::unix::ffi::OsStrExt;
        use std::path::{Path, PathBuf};

        /// The directory of the shared object (or executable) holding this code.
        pub(super) fn own_dir() -> Option<PathBuf> {
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

        /// The paths of the objects loaded into this process.
        pub(super) fn loaded_objects() -> Vec<PathBuf> {
            let mut found: Vec<PathBuf> = Vec::new();
            unsafe extern "C" fn visit(
                info: *mut libc::dl_phdr_info,
                _size: libc::size_t,
                data: *mut libc::c_void,
            ) -> libc::c_int {
                // SAFETY: dl_iterate_phdr passes a valid `dl_phdr_info` for each
                // loaded object, and `data` is the `&mut Vec<PathBuf>` below.
                let (info, found) = unsafe { (&*info, &mut *data.cast::<Vec<PathBuf>>()) };
                if !info.dlpi_name.is_null() {
                    // SAFETY: non-null, a NUL-terminated path owned by the loader.
                    let name = unsafe { CStr::from_ptr(info.dlpi_name) };
                    found.push(PathBuf::from(OsStr::from_bytes(name.to_bytes())));
                }
                0
            }
            // SAFETY: `visit` only reads what the loader hands it and writes
            // through `data`, which points at `found` for the whole call.
            unsafe {
                libc::dl_iterate_phdr(Some(visit), (&raw mut found).cast());
            }
            found
        }
    }

    #[cfg(windows)]
    mod windows {
        use std::ffi::OsString;
        use std::os::windows::ffi::OsStringExt;
        use std::path::{Path, PathBuf};

        use windows_sys::Win32::Foundation::HMODULE;
        use windows_sys::Win32::System::LibraryLoader::{
            GetModuleFileNameW, GetModuleHandleExW, GET_MODULE_HANDLE_EX_FLAG_FROM_ADDRESS,
            GET_MODULE_HANDLE_EX_FLAG_UNCHANGED_REFCOUNT,
        };
        use windows_sys::Win32::System::ProcessStatus::K32EnumProcessModules;
        use windows_sys::Win32::System::Threading::GetCurrentProcess;

        /// A module's file path (None past 32,767 UTF-16 units, the longest
        /// path Windows has).
        fn module_path(module: HMODULE) -> Option<PathBuf> {
            let mut buf = vec![0u16; 32_768];
            // SAFETY: `buf` is writable for its whole length, which is passed.
            let n = unsafe { GetModuleFileNameW(module, buf.as_mut_ptr(), buf.len() as u32) };
            let n = n as usize;
            (n > 0 && n < buf.len()).then(|| PathBuf::from(OsString::from_wide(&buf[..n])))
        }

        /// The directory of the DLL (or executable) holding this code.
        pub(super) fn own_dir() -> Option<PathBuf> {
            let mut module: HMODULE = std::ptr::null_mut();
            let addr = own_dir as fn() -> Option<PathBuf> as *const u16;
            // SAFETY: with FROM_ADDRESS the "name" is an address inside a
            // module (this function's); UNCHANGED_REFCOUNT takes no reference,
            // and the handle stays valid while this code is loaded.
            let ok = unsafe {
                GetModuleHandleExW(
                    GET_MODULE_HANDLE_EX_FLAG_FROM_ADDRESS
                        | GET_MODULE_HANDLE_EX_FLAG_UNCHANGED_REFCOUNT,
                    addr,
                    &mut module,
                )
            };
            if ok == 0 {
                return None;
            }
            module_path(module)?.parent().map(Path::to_path_buf)
        }

        /// The paths of the modules loaded into this process.
        pub(super) fn loaded_objects() -> Vec<PathBuf> {
            let mut modules: Vec<HMODULE> = vec![std::ptr::null_mut(); 1024];
            let mut needed = 0u32;
            // SAFETY: `modules` is writable for the byte length passed; the
            // pseudo-handle of the current process needs no closing.
            let ok = unsafe {
                K32EnumProcessModules(
                    GetCurrentProcess(),
                    modules.as_mut_ptr(),
                    (modules.len() * size_of::<HMODULE>()) as u32,
                    &mut needed,
                )
            };
            if ok == 0 {
                return Vec::new();
            }
            let n = (needed as usize / size_of::<HMODULE>()).min(modules.len());
            modules[..n]
                .iter()
                .filter_map(|&m| module_path(m))
                .collect()
        }
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
