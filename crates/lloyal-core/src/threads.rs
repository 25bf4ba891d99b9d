//! How many threads a CPU decode uses when other work wants the cores.
//!
//! llama.cpp's decode threads wait for each other at every barrier of the
//! graph, spinning. When the machine has more runnable threads than cores
//! (a busy process beside us, our own event loop), a descheduled decode
//! thread holds up all the others, and their spinning takes the time slice
//! it needs: on the 2-core machine with one busy process, SmolLM2 decoded
//! 34 tokens/s with 2 threads and 82 with 1 (`bench/contention.py`).
//!
//! So a context created without `n_threads` (every core) adapts: the
//! worker thread, which computes its share of every decode, reads how long
//! it waited on a run queue during its decodes (`/proc/thread-self/
//! schedstat`, the kernel's per-thread scheduler statistics). Over each
//! window of `WINDOW` of decode time:
//! - waiting more than `CROWDED` of it: one thread fewer (down to 1);
//! - waiting less than `FREE` with fewer threads than cores: one more, on
//!   probation. A thread fewer cannot tell whether the cores came free
//!   (its own wait is small either way), so a probe is how it finds out;
//!   a probe that finds the machine still crowded doubles the time before
//!   the next (`PROBE_AFTER` up to `PROBE_AFTER_MAX`), so a machine that
//!   stays busy costs one window every few seconds.
//!
//! An explicit `n_threads` is used as given, and so is every thread count
//! where the kernel has no such statistics (not Linux, or schedstats off),
//! on a context that offloads to a GPU, and in the deterministic mode.
//! `LLOYAL_ADAPTIVE_THREADS=0` turns the adaptation off.

use std::time::Duration;

/// Decode time per decision.
const WINDOW: Duration = Duration::from_millis(100);
/// Run-queue wait (a share of decode time) above which a thread is dropped.
const CROWDED: f64 = 0.15;
/// Run-queue wait below which a thread is tried again.
const FREE: f64 = 0.05;
/// Decode time before the first probe, and its most after failed ones.
const PROBE_AFTER: Duration = Duration::from_secs(1);
const PROBE_AFTER_MAX: Duration = Duration::from_secs(8);

/// The thread count of one context's decodes.
pub(crate) struct Threads {
    most: u32,
    now: u32,
    clock: Option<RunQueueClock>,
    /// Decode time and run-queue wait in the window so far.
    window: Duration,
    waited: Duration,
    /// Decode time since the last change, and before the next probe.
    since_change: Duration,
    probe_after: Duration,
    /// Whether the last change was a probe, to be judged by this window.
    probing: bool,
}

impl Threads {
    /// `most` threads; adaptive when `adapt` (the context's `n_threads`
    /// was left to the machine) and the kernel keeps the statistics.
    pub(crate) fn new(most: u32, adapt: bool) -> Self {
        let enabled = adapt
            && most > 1
            && std::env::var("LLOYAL_ADAPTIVE_THREADS").map_or(true, |v| v.trim() != "0");
        Threads {
            most,
            now: most,
            clock: if enabled { RunQueueClock::open() } else { None },
            window: Duration::ZERO,
            waited: Duration::ZERO,
            since_change: Duration::ZERO,
            probe_after: PROBE_AFTER,
            probing: false,
        }
    }

    /// The threads the next decode uses.
    pub(crate) fn now(&self) -> u32 {
        self.now
    }

    /// The worker's run-queue clock before a decode (None: not adapting).
    pub(crate) fn before(&mut self) -> Option<Duration> {
        self.clock.as_mut().and_then(RunQueueClock::read)
    }

    /// Account a decode that took `took` and started at run-queue clock
    /// `start`; returns the new thread count when it changes.
    pub(crate) fn after(&mut self, start: Option<Duration>, took: Duration) -> Option<u32> {
        let end = self.clock.as_mut().and_then(RunQueueClock::read)?;
        let start = start?;
        self.window += took;
        self.waited += end.saturating_sub(start);
        self.since_change += took;
        if self.window < WINDOW {
            return None;
        }
        let share = self.waited.as_secs_f64() / self.window.as_secs_f64();
        self.window = Duration::ZERO;
        self.waited = Duration::ZERO;
        self.judge(share)
    }

    /// The decision at the end of a window in which the worker waited
    /// `share` of its decode time on a run queue.
    fn judge(&mut self, share: f64) -> Option<u32> {
        let probed = std::mem::take(&mut self.probing);
        let due = self.since_change >= self.probe_after;
        match decide(self.now, self.most, share, probed, due) {
            Step::Stay => None,
            Step::Fewer => {
                if probed {
                    self.probe_after = (self.probe_after * 2).min(PROBE_AFTER_MAX);
                }
                self.change(self.now - 1)
            }
            Step::Probe => {
                self.probing = true;
                self.change(self.now + 1)
            }
            Step::Kept => {
                self.probe_after = PROBE_AFTER;
                None
            }
        }
    }

    fn change(&mut self, to: u32) -> Option<u32> {
        self.now = to;
        self.since_change = Duration::ZERO;
        Some(to)
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Step {
    Stay,
    /// One thread fewer.
    Fewer,
    /// One thread more, judged by the next window.
    Probe,
    /// A probe that found the cores free: its thread stays.
    Kept,
}

/// The decision after a window in which the worker waited `share` of its
/// decode time on a run queue, with `now` of `most` threads; `probed`: the
/// window ran a probe's extra thread; `due`: a probe may be tried.
fn decide(now: u32, most: u32, share: f64, probed: bool, due: bool) -> Step {
    if share > CROWDED && now > 1 {
        Step::Fewer
    } else if probed {
        Step::Kept
    } else if share < FREE && now < most && due {
        Step::Probe
    } else {
        Step::Stay
    }
}

/// The calling thread's time spent runnable but not running, from
/// `/proc/thread-self/schedstat` ("run_ns wait_ns timeslices"): opened on
/// the worker thread, read only there.
struct RunQueueClock {
    #[cfg(target_os = "linux")]
    file: std::fs::File,
}

impl RunQueueClock {
    #[cfg(target_os = "linux")]
    fn open() -> Option<Self> {
        let file = std::fs::File::open("/proc/thread-self/schedstat").ok()?;
        let mut clock = RunQueueClock { file };
        clock.read().map(|_| clock)
    }

    #[cfg(not(target_os = "linux"))]
    fn open() -> Option<Self> {
        None
    }

    #[cfg(target_os = "linux")]
    fn read(&mut self) -> Option<Duration> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 96];
        let n = self.file.read_at(&mut buf, 0).ok()?;
        let text = std::str::from_utf8(&buf[..n]).ok()?;
        let wait: u64 = text.split_ascii_whitespace().nth(1)?.parse().ok()?;
        Some(Duration::from_nanos(wait))
    }

    #[cfg(not(target_os = "linux"))]
    fn read(&mut self) -> Option<Duration> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crowded_drops_a_thread_and_a_failed_probe_backs_off() {
        assert_eq!(decide(2, 2, 0.30, false, false), Step::Fewer);
        assert_eq!(decide(1, 2, 0.30, false, true), Step::Stay); // never below 1
        assert_eq!(decide(1, 2, 0.01, false, false), Step::Stay); // not due yet
        assert_eq!(decide(1, 2, 0.01, false, true), Step::Probe);
        assert_eq!(decide(2, 2, 0.30, true, false), Step::Fewer);
        assert_eq!(decide(2, 2, 0.01, true, false), Step::Kept);
        assert_eq!(decide(2, 2, 0.01, false, true), Step::Stay); // all cores already
                                                                 // Between the two bounds nothing moves.
        assert_eq!(decide(2, 4, 0.10, false, true), Step::Stay);
    }

    #[test]
    fn a_window_of_waiting_takes_a_thread_and_probes_come_back() {
        let mut t = Threads::new(2, false);
        assert!(t.clock.is_none());
        assert_eq!(t.after(None, WINDOW), None); // no clock: nothing changes
        assert_eq!(t.now(), 2);
        let window = |t: &mut Threads, share: f64, took: Duration| {
            t.since_change += took;
            t.judge(share)
        };
        assert_eq!(window(&mut t, 0.5, WINDOW), Some(1));
        assert_eq!(window(&mut t, 0.0, WINDOW), None); // a probe is not due yet
        assert_eq!(window(&mut t, 0.0, PROBE_AFTER), Some(2)); // the probe
        assert_eq!(window(&mut t, 0.5, WINDOW), Some(1)); // failed: back off
        assert_eq!(t.probe_after, PROBE_AFTER * 2);
        assert_eq!(window(&mut t, 0.0, PROBE_AFTER), None);
        assert_eq!(window(&mut t, 0.0, PROBE_AFTER), Some(2));
        assert_eq!(window(&mut t, 0.0, WINDOW), None); // kept
        assert_eq!((t.now(), t.probe_after), (2, PROBE_AFTER));
        assert_eq!(window(&mut t, 0.0, PROBE_AFTER_MAX), None); // all cores already
    }

    #[test]
    fn the_worker_thread_can_read_its_run_queue_clock() {
        if cfg!(target_os = "linux") && std::path::Path::new("/proc/thread-self/schedstat").exists()
        {
            let mut clock = RunQueueClock::open().expect("schedstat parses");
            let a = clock.read().expect("a reading");
            let b = clock
                .read()
                .expect("a second reading (re-read at offset 0)");
            assert!(b >= a);
        }
    }
}
