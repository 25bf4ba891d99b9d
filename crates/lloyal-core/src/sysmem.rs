//! How much memory the process can still take: the smaller of the kernel's
//! `MemAvailable` and what the cgroup (a container's limit) leaves; on
//! Windows, the available physical memory (`GlobalMemoryStatusEx`).

/// Bytes the process can still allocate, where the platform tells.
#[cfg(windows)]
pub(crate) fn available_bytes() -> Option<u64> {
    use windows_sys::Win32::System::SystemInformation::{GlobalMemoryStatusEx, MEMORYSTATUSEX};
    // SAFETY: MEMORYSTATUSEX is plain data; all-zero is a valid value.
    let mut status: MEMORYSTATUSEX = unsafe { std::mem::zeroed() };
    status.dwLength = size_of::<MEMORYSTATUSEX>() as u32;
    // SAFETY: `status` is writable and its dwLength set, as the call needs.
    let ok = unsafe { GlobalMemoryStatusEx(&mut status) };
    (ok != 0).then_some(status.ullAvailPhys)
}

/// Bytes the process can still allocate, where the platform tells.
#[cfg(not(windows))]
pub(crate) fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let system = meminfo.as_deref().and_then(mem_available);
    let cgroup = cgroup_left();
    match (system, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` from the text of `/proc/meminfo`, in bytes.
#[cfg_attr(windows, allow(dead_code))] // tested everywhere, used off Windows
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// cgroup v2: `memory.max - memory.current` of the process's own cgroup.
#[cfg(not(windows))]
fn cgroup_left() -> Option<u64> {
    let dir = std::path::Path::new("/sys/fs/cgroup");
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let max: u64 = read("memory.max")?.trim().parse().ok()?; // "max" = no limit
    let current: u64 = read("memory.current")?.trim().parse().ok()?;
    Some(max.saturating_sub(current))
}

/// Hand freed heap memory back to the OS (glibc keeps it otherwise: a
/// closed context's buffers, freed on its worker thread, stayed in the
/// process's RSS, about 9 MiB per SmolLM2 context).
pub(crate) fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::os::raw::c_int;
        }
        // SAFETY: glibc's malloc_trim takes no pointers and may be called
        // from any thread at any time.
        unsafe {
            malloc_trim(0);
        }
    }
}

/// `1.5 GiB`, `12.0 MiB`, `512 B`.
pub(crate) fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mem_available() {
        let text = "MemTotal:       24000000 kB\nMemAvailable:   1000 kB\n";
        assert_eq!(mem_available(text), Some(1_024_000));
        assert_eq!(mem_available("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn formats_sizes() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 29), "1.5 GiB");
    }
}
