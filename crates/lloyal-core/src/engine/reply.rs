//! Replies: how a job's result goes back to its caller, never lost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};

/// How a job's result is handed back: [`Reply::send`] calls the function
/// once, on the worker thread; it must not block for long (it only
/// completes a future). A reply dropped unsent (a job that panicked, a
/// worker that never started) answers [`Error::Internal`] instead, so no
/// caller waits forever.
pub struct Reply<T: 'static> {
    answer: Option<Box<dyn FnOnce(Result<T>) + Send + 'static>>,
    cancel: Option<Arc<AtomicBool>>,
}

impl<T: 'static> Reply<T> {
    pub fn new(f: impl FnOnce(Result<T>) + Send + 'static) -> Self {
        Reply {
            answer: Some(Box::new(f)),
            cancel: None,
        }
    }

    /// The caller may give up: once `flag` is set, a job that honours it
    /// (a step group, between its rounds) stops, undoes what it did and
    /// answers [`Error::Cancelled`]. A job that has finished is answered as
    /// usual.
    #[must_use]
    pub fn cancel_with(mut self, flag: Arc<AtomicBool>) -> Self {
        self.cancel = Some(flag);
        self
    }

    /// The flag of [`Reply::cancel_with`], for a reply that wraps this one.
    pub(crate) fn cancel_flag(&self) -> Option<Arc<AtomicBool>> {
        self.cancel.clone()
    }

    /// Whether the caller gave up on this reply.
    pub fn cancelled(&self) -> bool {
        self.cancel
            .as_ref()
            .is_some_and(|flag| flag.load(Ordering::Acquire))
    }

    /// Answer with `result`.
    pub fn send(mut self, result: Result<T>) {
        if let Some(f) = self.answer.take() {
            f(result);
        }
    }
}

impl<T: 'static> Drop for Reply<T> {
    fn drop(&mut self) {
        if let Some(f) = self.answer.take() {
            let panicking = std::thread::panicking();
            // After the job (on the worker): once the worker has freed the
            // job's branches, so the caller finds them usable, and knows
            // what the panic said (`run` keeps it in `PANIC`).
            after_job(Box::new(move || {
                let message = PANIC.with(|p| p.borrow().clone());
                f(Err(unanswered(panicking, message.as_deref())));
            }));
        }
    }
}

/// The error a caller gets for a request the engine could not answer: it
/// panicked (with the panic's message when known) or dropped the request.
pub(crate) fn unanswered(panicked: bool, message: Option<&str>) -> Error {
    let why = match message {
        Some(message) if panicked => {
            format!("the engine panicked while running this request: {message}")
        }
        _ if panicked => "the engine panicked while running this request".to_owned(),
        _ => "the engine dropped this request without an answer".to_owned(),
    };
    Error::Internal(format!("{why} (a bug in lloyal: please report it)"))
}

pub(super) type Deferred = Box<dyn FnOnce() + Send>;

thread_local! {
    /// What the job that just panicked on this worker said, for the
    /// replies it dropped (see `Reply`'s `Drop`).
    static PANIC: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
    /// Replies deferred by [`after_job`] while the worker runs a job.
    static AFTER_JOB: std::cell::RefCell<Option<Vec<Deferred>>> =
        const { std::cell::RefCell::new(None) };
}

/// Run `f` once the job the worker thread is running has finished and the
/// worker is free again; at once on any other thread. Reply callbacks use
/// this so that whoever a reply wakes finds the worker idle (and can run
/// short work inline) instead of racing its last steps. Replies still run
/// in the order they were given.
pub fn after_job(f: Deferred) {
    let now = AFTER_JOB.with(|q| match q.borrow_mut().as_mut() {
        Some(queue) => {
            queue.push(f);
            None
        }
        None => Some(f),
    });
    if let Some(f) = now {
        f();
    }
}

/// Start deferring replies on this thread (the worker, as a job starts),
/// into `buffer` (empty; reused from job to job).
pub(super) fn defer_replies(buffer: Vec<Deferred>) {
    AFTER_JOB.with(|q| *q.borrow_mut() = Some(buffer));
}

/// Stop deferring and hand over what was deferred, in order.
pub(super) fn deferred_replies() -> Vec<Deferred> {
    AFTER_JOB
        .with(|q| q.borrow_mut().take())
        .unwrap_or_default()
}

/// Keep what a panicking job said for the replies it dropped (`None`: the
/// job is over, forget it).
pub(super) fn set_panic_message(message: Option<String>) {
    PANIC.with(|p| *p.borrow_mut() = message);
}

/// A panic's message, for an error that names it.
pub(crate) fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    match Error::from_panic(payload) {
        Error::Internal(m) => m,
        other => other.to_string(),
    }
}
