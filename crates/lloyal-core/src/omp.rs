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
//!
//! [`Background`] goes one step further for work that is not needed at
//! once: it starts a team with libgomp's split entry points
//! (`GOMP_parallel_start` ... `GOMP_parallel_end`, what `#pragma omp
//! parallel` compiled to before GCC 4.9, still exported) and lets the
//! worker thread go on -- reply, wait for the next job -- while the other
//! threads of the team work. The worker joins in, and ends the region,
//! before its next job (before anything else that uses OpenMP).

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
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
    // The split form: starts the team's other threads on `f(data)` and
    // returns at once; the caller is expected to run `f(data)` itself and
    // then call `GOMP_parallel_end`, which returns when all have returned.
    fn GOMP_parallel_start(f: extern "C" fn(*mut c_void), data: *mut c_void, num_threads: u32);
    fn GOMP_parallel_end();
}

// Where llama.cpp is not built with libgomp (macOS's clang, MSVC) there is
// no team to borrow: the caller does all the work itself. `for_each` then
// runs its items in order, and a `Background`'s items run in `finish`.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
#[allow(non_snake_case, clippy::missing_safety_doc)]
unsafe fn GOMP_parallel(f: extern "C" fn(*mut c_void), data: *mut c_void, _: u32, _: u32) {
    f(data);
}
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
#[allow(non_snake_case)]
unsafe fn GOMP_parallel_start(_: extern "C" fn(*mut c_void), _: *mut c_void, _: u32) {}
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
#[allow(non_snake_case)]
unsafe fn GOMP_parallel_end() {}

struct Shared<'a> {
    work: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    panicked: AtomicBool,
}

/// Take items `next..n` one at a time (shared with the other threads) and
/// run `work` on each. A panic must not unwind into C: it is noted in
/// `panicked` and re-raised by the caller afterwards.
fn take_items(work: &(dyn Fn(usize) + Sync), n: usize, next: &AtomicUsize, panicked: &AtomicBool) {
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n {
            return;
        }
        if catch_unwind(AssertUnwindSafe(|| work(i))).is_err() {
            panicked.store(true, Ordering::Relaxed);
        }
    }
}

extern "C" fn run(data: *mut c_void) {
    // SAFETY: `data` points to the `Shared` on `for_each`'s stack, which
    // outlives the parallel region (GOMP_parallel returns only after every
    // thread has left this function); it is only read, and its mutable
    // parts are atomics.
    let shared = unsafe { &*(data as *const Shared<'_>) };
    take_items(shared.work, shared.n, &shared.next, &shared.panicked);
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

/// What the team's other threads work on in the background.
struct Owned {
    work: Box<dyn Fn(usize) + Send + Sync>,
    n: usize,
    next: AtomicUsize,
    panicked: AtomicBool,
    /// Set when the caller finishes: the lingering threads return.
    joined: AtomicBool,
}

impl Owned {
    /// Run items until none is left.
    fn run_items(&self) {
        take_items(&*self.work, self.n, &self.next, &self.panicked);
    }
}

/// How long the team's other threads stay awake, spinning, after their
/// background items, waiting for the caller to finish (its next decode).
///
/// libgomp's own wait between parallel regions spins for a count of
/// iterations (`GOMP_SPINCOUNT`, 300,000 by default: a fraction of a
/// millisecond to a few, by CPU) and then sleeps; the next decode must then
/// wake the thread, and on a busy virtual machine that wake-up can take
/// milliseconds (a sleeping vCPU waits for the host). Between two decodes
/// of a Python loop (the event loop picks the next tokens) the threads
/// did fall asleep, and decodes were 5-20% slower than in a tight Rust
/// loop. llama.cpp asks for the same with LLVM's OpenMP (it sets
/// `KMP_BLOCKTIME` to 200 ms, which libgomp does not read). After this the
/// threads return to libgomp's own wait.
pub(crate) const LINGER: std::time::Duration = std::time::Duration::from_millis(20);

extern "C" fn run_owned(data: *mut c_void) {
    // SAFETY: `data` points into the `Box<Owned>` of a `Background`, which
    // ends the parallel region (`GOMP_parallel_end` returns only after
    // every thread has left this function) before the box is dropped.
    let shared = unsafe { &*(data as *const Owned) };
    shared.run_items();
    // Stay awake until the caller joins (or the linger passes: none while
    // another context may want the cores); reading the clock only every
    // few thousand spins, and yielding the core between them to any other
    // runnable thread (on a busy machine the spin must not take the time
    // slice another process or this one's own event loop needs).
    let until = std::time::Instant::now() + linger();
    while !shared.joined.load(Ordering::Acquire) {
        if std::time::Instant::now() >= until {
            return;
        }
        for _ in 0..2048 {
            std::hint::spin_loop();
        }
        std::thread::yield_now();
    }
}

/// `n` items of `work` that the OpenMP team's other threads start on now,
/// while the calling thread goes on; [`Background::finish`] (or dropping
/// it) makes the caller take the items left and waits for the rest. With
/// nothing (left) to do the other threads spin until the caller finishes,
/// for up to [`LINGER`], so the next decode finds them awake.
/// Between the two the caller is inside a parallel region: it must not
/// run OpenMP code (`llama_decode`, [`for_each`]) until it has finished,
/// and only it may finish (libgomp's rule for the thread that started a
/// region).
pub(crate) struct Background {
    owned: Option<Box<Owned>>,
    /// Whether a parallel region is open (more than one thread asked for).
    region: bool,
    /// The thread that started it, the only one that may finish it.
    starter: std::thread::ThreadId,
}

impl Background {
    pub(crate) fn start(n: usize, threads: u32, work: Box<dyn Fn(usize) + Send + Sync>) -> Self {
        let owned = Box::new(Owned {
            work,
            n,
            next: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            joined: AtomicBool::new(false),
        });
        let region = threads > 1;
        if region {
            // SAFETY: `run_owned` matches the callback type libgomp expects
            // and never unwinds; the box is neither moved out of nor freed
            // before `finish` has called `GOMP_parallel_end`.
            unsafe {
                GOMP_parallel_start(run_owned, &*owned as *const Owned as *mut c_void, threads);
            }
        }
        Self {
            owned: Some(owned),
            region,
            starter: std::thread::current().id(),
        }
    }

    /// Whether this thread may finish it (it started it).
    pub(crate) fn is_mine(&self) -> bool {
        self.starter == std::thread::current().id()
    }

    /// Run the items no other thread has taken, then wait for the others.
    pub(crate) fn finish(mut self) {
        self.end();
    }

    fn end(&mut self) {
        let Some(owned) = self.owned.take() else {
            return;
        };
        owned.joined.store(true, Ordering::Release);
        owned.run_items();
        if self.region {
            // SAFETY: called once, on the thread that started the region.
            unsafe { GOMP_parallel_end() };
        }
        assert!(
            !owned.panicked.load(Ordering::Relaxed),
            "a background row task panicked"
        );
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            self.end();
        } else if let Some(owned) = self.owned.take() {
            // Unwinding: still end the region (no assert), so the other
            // threads are released and the box outlives them.
            owned.joined.store(true, Ordering::Release);
            owned.run_items();
            if self.region {
                // SAFETY: as in `end`.
                unsafe { GOMP_parallel_end() };
            }
        }
    }
}

// -- how the contexts of one process share the CPU -----------------------------
//
// Between decodes a context keeps its OpenMP team awake for a moment
// (`LINGER`), so that the next decode does not wait for its
// threads to wake up (on the 2-core machine a decode of SmolLM2 takes 9
// ms with the team awake and 23 ms when its threads must be woken). That
// spinning takes cores from whatever else wants them. Another context of
// the same process does, when both decode: the teams' spinning held each
// other up (two contexts decoding at once reached 0.84-0.9x the tokens per
// second of one alone). So while more than one CPU context is open the
// team does not linger (`linger`); two contexts then reach 0.92-1.03x
// (`bench/contention.py`). Making their decodes take turns instead (a
// process-wide lock) was measured too, and was worse: 0.57-0.68x, each
// decode finding its team asleep. The linger's spin also yields its core
// between rounds to any other runnable thread (`run_owned`).
//
// The other half, a decode's threads on a machine with more runnable
// threads than cores, is `threads`: fewer of them. (Until 2026-11-29 the
// Python package set libgomp's `GOMP_SPINCOUNT` to 1,000 instead, which
// cost 2-10% on an idle machine: docs/performance.md.)

/// Open contexts whose decodes run on the CPU.
static CPU_CONTEXTS: AtomicUsize = AtomicUsize::new(0);

/// A CPU context, counted while the value lives (its worker holds it).
pub(crate) struct CpuContext(());

impl CpuContext {
    pub(crate) fn open() -> Self {
        CPU_CONTEXTS.fetch_add(1, Ordering::AcqRel);
        CpuContext(())
    }
}

impl Drop for CpuContext {
    fn drop(&mut self) {
        CPU_CONTEXTS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Whether more than one CPU context is open.
pub(crate) fn shared() -> bool {
    CPU_CONTEXTS.load(Ordering::Acquire) > 1
}

/// How long a team stays awake after a decode: [`LINGER`],
/// or not at all while another CPU context may want the cores.
pub(crate) fn linger() -> Duration {
    if shared() {
        Duration::ZERO
    } else {
        LINGER
    }
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
    fn background_items_all_run_once_and_finish_waits_for_them() {
        use std::sync::Arc;
        for threads in [1, 2, 4] {
            for n in [0, 1, 5, 64] {
                let seen: Arc<Vec<Mutex<u32>>> = Arc::new((0..n).map(|_| Mutex::new(0)).collect());
                let work = Arc::clone(&seen);
                let bg =
                    Background::start(n, threads, Box::new(move |i| *work[i].lock().unwrap() += 1));
                // The caller is free meanwhile (no OpenMP here).
                let _ = (0..1000).sum::<u64>();
                bg.finish();
                assert!(seen.iter().all(|c| *c.lock().unwrap() == 1));
                // A new region after the old one ended.
                for_each(4, threads, &|_| ());
            }
        }
    }

    #[test]
    fn a_background_panic_is_raised_on_finish() {
        let bg = Background::start(4, 2, Box::new(|i| assert_ne!(i, 2, "boom")));
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| bg.finish()));
        assert!(result.is_err());
    }

    #[test]
    fn a_panic_is_raised_on_the_caller() {
        let result = std::panic::catch_unwind(|| {
            for_each(4, 2, &|i| assert_ne!(i, 2, "boom"));
        });
        assert!(result.is_err());
    }

    #[test]
    fn a_second_cpu_context_stops_the_linger() {
        let a = CpuContext::open();
        let b = CpuContext::open();
        assert!(shared());
        assert_eq!(linger(), Duration::ZERO);
        drop((a, b));
    }
}
