//! The worker thread's loop.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;

use crossbeam_channel::RecvTimeoutError;
use tokio::sync::mpsc::UnboundedReceiver;

use super::job::Job;
use super::reply::{
    defer_replies, deferred_replies, panic_text, set_panic_message, unanswered, Deferred,
};
use super::step::Step;
use super::worker::{Engine, Worker};
use crate::error::Error;
use crate::sync::lock;

/// Run jobs in order until the context closes. Each wake-up takes
/// everything queued. Steps queued back to back merge into the step in
/// progress, which runs one round (one decode) at a time, so that steps
/// arriving meanwhile join its next round (see `step`). A job that touches
/// none of the step's branches and decodes nothing (`Task::overtakes`: a
/// fork, a truncation, a prune) runs between two rounds; any other job
/// waits until the step has finished, and runs on its own. Either way a
/// branch sees its jobs in the order they were submitted.
pub(super) fn run(engine: &Engine, rx: &mut UnboundedReceiver<Job>) {
    let mut queue: VecDeque<Job> = VecDeque::new();
    let mut step = Step::default();
    // Replies deferred during a job; the buffer is reused from job to job.
    let mut replies: Vec<Deferred> = Vec::new();
    loop {
        if queue.is_empty() && step.is_empty() {
            match rx.blocking_recv() {
                Some(job) => queue.push_back(job),
                None => break,
            }
        }
        while let Ok(job) = rx.try_recv() {
            queue.push_back(job);
        }
        // Steps queued next to each other join the step in progress; jobs
        // that touch none of its branches (a fork, a prune) run between
        // its rounds instead of waiting for it to finish.
        loop {
            while let Some(Job::Step(_)) = queue.front() {
                if let Some(Job::Step(next)) = queue.pop_front() {
                    step.extend(next);
                }
            }
            if step.is_empty() || !overtakes(engine, queue.front(), &step) {
                break;
            }
            if let Some(job) = queue.pop_front() {
                run_job(engine, &mut replies, job);
            }
        }
        if !step.is_empty() {
            run_locked(engine, &mut replies, |w| match w {
                Some(w) => {
                    let recover = step.ids();
                    match catch_unwind(AssertUnwindSafe(|| w.step_round(&mut step))) {
                        Ok(finished) => finished,
                        Err(payload) => {
                            // Free the step's branches, then tell every
                            // caller in it what happened.
                            let message = panic_text(payload);
                            let _ = catch_unwind(AssertUnwindSafe(|| w.abandon_step(recover)));
                            let step = std::mem::take(&mut step);
                            let groups = step.groups.len();
                            step.fail(unanswered(true, Some(&message)));
                            groups
                        }
                    }
                }
                None => {
                    let step = std::mem::take(&mut step);
                    let groups = step.groups.len();
                    step.fail(Error::ContextClosed);
                    groups
                }
            });
            continue;
        }
        let Some(job) = queue.pop_front() else {
            continue;
        };
        if let Job::Close { reply } = job {
            rx.close();
            for rest in queue.drain(..) {
                rest.fail(Error::ContextClosed);
            }
            while let Ok(rest) = rx.try_recv() {
                rest.fail(Error::ContextClosed);
            }
            let mut guard = lock(&engine.worker);
            if let Some(w) = guard.as_mut() {
                w.finish_background();
                // Free every branch's state and the llama.cpp context here,
                // on the thread that used them, then give the memory back.
                let states = lock(&w.shared.branches).take_all();
                drop(states);
            }
            drop(guard.take());
            drop(guard);
            crate::sysmem::release_free_memory();
            reply.send(Ok(()));
            return;
        }
        run_job(engine, &mut replies, job);
    }
    let mut guard = lock(&engine.worker);
    if let Some(w) = guard.as_mut() {
        w.finish_background();
    }
    drop(guard.take());
}

/// Whether `job` may run ahead of `step` (see `Task::overtakes`).
fn overtakes(engine: &Engine, job: Option<&Job>, step: &Step) -> bool {
    let Some(Job::Task(task)) = job else {
        return false;
    };
    let guard = lock(&engine.worker);
    guard
        .as_ref()
        .is_some_and(|w| task.overtakes(w, &step.ids()))
}

/// Run one job other than a step or the close.
fn run_job(engine: &Engine, replies: &mut Vec<Deferred>, job: Job) {
    run_locked(engine, replies, |w| match w {
        Some(w) => {
            let recover = match &job {
                Job::Task(task) => task.recover(),
                _ => None,
            };
            // A job that panics has answered its caller (its reply was
            // dropped unsent: see `Reply`); put right what the task says
            // (free its branches) and go on with the next job.
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| w.execute(job))) {
                set_panic_message(Some(panic_text(payload)));
                if let Some(recover) = recover {
                    let _ = catch_unwind(AssertUnwindSafe(|| recover(w)));
                }
            }
            1
        }
        None => {
            job.fail(Error::ContextClosed);
            1
        }
    });
}

/// Run `f` holding the worker (`None` once the context is closed); `f`
/// returns how many submitted jobs (step groups) it finished. They stop
/// counting as queued before their replies go out, so that a caller who
/// hears back finds the worker idle (inline work runs only then).
fn run_locked(
    engine: &Engine,
    replies: &mut Vec<Deferred>,
    f: impl FnOnce(Option<&mut Worker<'static>>) -> usize,
) {
    let mut guard = lock(&engine.worker);
    if let Some(w) = guard.as_mut() {
        w.finish_background();
    }
    defer_replies(std::mem::take(replies));
    let worker = guard
        .as_mut()
        .filter(|w| !w.shared.closed.load(Ordering::Acquire));
    let finished = f(worker);
    drop(guard);
    engine.queued.fetch_sub(finished, Ordering::SeqCst);
    *replies = deferred_replies();
    for reply in replies.drain(..) {
        reply();
    }
    set_panic_message(None);
}

impl Worker<'_> {
    fn execute(&mut self, job: Job) {
        #[cfg(feature = "testing")]
        self.maybe_panic();
        match job {
            Job::Task(task) => task.run(self),
            Job::Hold { until } => {
                // Ends when the `Hold` is dropped (disconnected), or when
                // the context closes: a holder that waits for the close
                // (Python's `close_sync` on the loop thread that would
                // release the hold) must not deadlock.
                let tick = std::time::Duration::from_millis(2);
                while let Err(RecvTimeoutError::Timeout) = until.recv_timeout(tick) {
                    if self.shared.closed.load(Ordering::Acquire) {
                        break;
                    }
                }
            }
            Job::Step(_) | Job::Close { .. } => unreachable!("handled by run"),
        }
    }

    /// Panic if a test asked for it (`Context::panic_next_job`).
    #[cfg(feature = "testing")]
    pub(crate) fn maybe_panic(&self) {
        if self.shared.panic_next.swap(false, Ordering::SeqCst) {
            panic!("injected by Context::panic_next_job");
        }
    }
}
