//! The worker thread's loop.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;

use crossbeam_channel::RecvTimeoutError;
use tokio::sync::mpsc::UnboundedReceiver;

use super::job::{merge, Job};
use super::reply::{defer_replies, deferred_replies, set_panic_message, Deferred};
use super::worker::{Engine, Worker};
use crate::error::Error;
use crate::sync::lock;

/// Run jobs in order, each holding the worker, until the context closes.
/// Each wake-up takes everything queued (one batch), and a job absorbs the
/// jobs behind it that it can (see `Task::absorb`).
pub(super) fn run(engine: &Engine, rx: &mut UnboundedReceiver<Job>) {
    let mut pending: Vec<(Job, usize)> = Vec::new();
    // Replies deferred during a job; the buffer is reused from job to job.
    let mut replies: Vec<Deferred> = Vec::new();
    while let Some(first) = rx.blocking_recv() {
        pending.push((first, 1));
        while let Ok(job) = rx.try_recv() {
            pending.push((job, 1));
        }
        let mut batch = merge(pending.drain(..)).into_iter();
        while let Some((job, merged)) = batch.next() {
            let hold = matches!(job, Job::Hold { .. });
            let mut guard = lock(&engine.worker);
            if let Some(w) = guard.as_mut() {
                w.finish_background();
            }
            if let Job::Close { reply } = job {
                rx.close();
                for (rest, _) in batch.by_ref() {
                    rest.fail(Error::ContextClosed);
                }
                while let Ok(rest) = rx.try_recv() {
                    rest.fail(Error::ContextClosed);
                }
                // Free every branch's state and the llama.cpp context here,
                // on the thread that used them, then give the memory back.
                if let Some(w) = guard.as_ref() {
                    let states = lock(&w.shared.branches).take_all();
                    drop(states);
                }
                drop(guard.take());
                drop(guard);
                crate::sysmem::release_free_memory();
                reply.send(Ok(()));
                return;
            }
            defer_replies(std::mem::take(&mut replies));
            match guard.as_mut() {
                Some(w) if !w.shared.closed.load(Ordering::Acquire) => {
                    let recover = match &job {
                        Job::Task(task) => task.recover(),
                        _ => None,
                    };
                    // A job that panics has answered its caller (its reply
                    // was dropped unsent: see `Reply`); put right what the
                    // task says (free its branches) and go on with the next
                    // job on this thread.
                    if let Err(payload) = catch_unwind(AssertUnwindSafe(|| w.execute(job))) {
                        let message = match Error::from_panic(payload) {
                            Error::Internal(m) => m,
                            other => other.to_string(),
                        };
                        set_panic_message(Some(message));
                        if let Some(recover) = recover {
                            let _ = catch_unwind(AssertUnwindSafe(|| recover(w)));
                        }
                    }
                }
                _ => job.fail(Error::ContextClosed),
            }
            drop(guard);
            engine.queued.fetch_sub(merged, Ordering::SeqCst);
            replies = deferred_replies();
            for reply in replies.drain(..) {
                reply();
            }
            set_panic_message(None);
            if hold {
                // What was queued during the hold joins the rest of this
                // batch, so that it merges with the jobs behind the hold.
                pending.extend(batch.by_ref());
                while let Ok(job) = rx.try_recv() {
                    pending.push((job, 1));
                }
                batch = merge(pending.drain(..)).into_iter();
            }
        }
    }
    let mut guard = lock(&engine.worker);
    if let Some(w) = guard.as_mut() {
        w.finish_background();
    }
    drop(guard.take());
}

impl Worker<'_> {
    fn execute(&mut self, job: Job) {
        #[cfg(feature = "testing")]
        if self.shared.panic_next.swap(false, Ordering::SeqCst) {
            panic!("injected by Context::panic_next_job");
        }
        match job {
            Job::Decode {
                tokens,
                pos,
                seq,
                reply,
            } => {
                let result = self.decode(&tokens, pos, seq);
                reply.send(result);
            }
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
            Job::Close { .. } => unreachable!("handled by run"),
        }
    }
}
