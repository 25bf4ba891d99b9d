//! Per-row work after a decode, run on llama.cpp's own OpenMP team.
//!
//! After a decode the worker copies each branch's logits row and computes
//! its stats (a vocabulary-sized scan with one `exp` per logit). llama.cpp's
//! OpenMP threads meanwhile spin, waiting for the next decode's parallel
//! region, so their cores are idle. This module hands the rows to that team
//! through `GOMP_parallel`, the libgomp entry point `#pragma omp parallel`
//! compiles to, from the worker thread (the thread that calls
//! `llama_decode`), with the decode's thread count: the same team, no new
//! threads. libgomp is linked already (llama-cpp-sys-2's `openmp` feature).

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

extern "C" {
    // libgomp's ABI for `#pragma omp parallel num_threads(n)`: runs
    // `f(data)` on every thread of the team (the caller included) and
    // returns when all have returned.
    fn GOMP_parallel(
        f: extern "C" fn(*mut c_void),
        data: *mut c_void,
        num_threads: u32,
        flags: u32,
    );
}

struct Shared<'a> {
    work: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    panicked: AtomicBool,
}

extern "C" fn run(data: *mut c_void) {
    // SAFETY: `data` points to the `Shared` on `for_each`'s stack, which
    // outlives the parallel region (GOMP_parallel returns only after every
    // thread has left this function); it is only read, and its mutable
    // parts are atomics.
    let shared = unsafe { &*(data as *const Shared<'_>) };
    loop {
        let i = shared.next.fetch_add(1, Ordering::Relaxed);
        if i >= shared.n {
            return;
        }
        // A panic must not unwind into C: note it, re-raise it afterwards.
        if catch_unwind(AssertUnwindSafe(|| (shared.work)(i))).is_err() {
            shared.panicked.store(true, Ordering::Relaxed);
        }
    }
}

/// Call `work(i)` for every `i` in `0..n`, spread over up to `threads`
/// threads of the calling thread's OpenMP team (items are taken one at a
/// time, so uneven items balance). Runs inline for a single item or
/// thread. Returns when every call has returned; a panic in `work` is
/// re-raised here, on the calling thread.
pub(crate) fn for_each(n: usize, threads: u32, work: &(dyn Fn(usize) + Sync)) {
    let threads = threads.min(u32::try_from(n).unwrap_or(u32::MAX));
    if threads <= 1 {
        (0..n).for_each(work);
        return;
    }
    let shared = Shared {
        work,
        n,
        next: AtomicUsize::new(0),
        panicked: AtomicBool::new(false),
    };
    // SAFETY: `run` matches the callback type libgomp expects and never
    // unwinds; `shared` lives until GOMP_parallel returns (see `run`).
    unsafe {
        GOMP_parallel(run, &shared as *const Shared<'_> as *mut c_void, threads, 0);
    }
    assert!(
        !shared.panicked.load(Ordering::Relaxed),
        "a parallel row task panicked"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn every_item_runs_once_on_any_thread_count() {
        for threads in [1, 2, 4] {
            for n in [0, 1, 2, 7, 64] {
                let seen: Vec<Mutex<u32>> = (0..n).map(|_| Mutex::new(0)).collect();
                for_each(n, threads, &|i| *seen[i].lock().unwrap() += 1);
                assert!(seen.iter().all(|c| *c.lock().unwrap() == 1));
            }
        }
    }

    #[test]
    fn a_panic_is_raised_on_the_caller() {
        let result = std::panic::catch_unwind(|| {
            for_each(4, 2, &|i| assert_ne!(i, 2, "boom"));
        });
        assert!(result.is_err());
    }
}
