//! Jobs: what callers send the worker. The engine's own jobs are variants;
//! branch, KV and embedding work is a [`Task`] that the module doing it
//! defines, so the engine knows nothing of it beyond this trait.

use std::any::Any;

use crossbeam_channel::{Receiver, Sender};

use super::reply::Reply;
use super::worker::Worker;
use crate::error::Error;

pub(crate) enum Job {
    Decode {
        tokens: Vec<i32>,
        pos: i32,
        seq: i32,
        reply: Reply<()>,
    },
    /// Work another module defines (branches, the flat KV API, embeddings).
    Task(Box<dyn Task>),
    Close {
        reply: Reply<()>,
    },
    /// Keep the worker busy until the sender side is dropped (see
    /// [`Context::hold`](super::Context::hold)).
    Hold {
        until: Receiver<()>,
    },
}

/// Cleanup of a task whose `run` panicked.
pub(crate) type Recover = Box<dyn FnOnce(&mut Worker<'_>) + Send>;

/// A value as `Any`, for [`Task::absorb`] to recognise its own kind
/// (implemented for every type). On a `Box<dyn Task>` call it through the
/// box (`(*task).as_any()`): the box itself is `Any` too.
pub(crate) trait AsAny {
    fn as_any(&self) -> &dyn Any;
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

impl<T: Any> AsAny for T {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// A job another module defines. The worker runs it (or fails it, when the
/// context closes first); its replies answer its callers.
pub(crate) trait Task: AsAny + Send + 'static {
    /// Run on the worker, holding it.
    fn run(self: Box<Self>, worker: &mut Worker<'_>);

    /// Answer every caller with `error` without running.
    fn fail(self: Box<Self>, error: Error);

    /// What the worker must put right if `run` panics (the replies have
    /// answered already, see `Reply`); asked before `run`.
    fn recover(&self) -> Option<Recover> {
        None
    }

    /// Take `next`, the job queued right behind this one, into this one so
    /// both run as one (commits of many callers become one decode), or hand
    /// it back.
    fn absorb(&mut self, next: Box<dyn Task>) -> std::result::Result<(), Box<dyn Task>> {
        Err(next)
    }
}

impl Job {
    pub(crate) fn task(task: impl Task) -> Job {
        Job::Task(Box::new(task))
    }

    pub(crate) fn fail(self, error: Error) {
        match self {
            Job::Decode { reply, .. } | Job::Close { reply } => reply.send(Err(error)),
            Job::Task(task) => task.fail(error),
            Job::Hold { .. } => {}
        }
    }
}

/// The jobs to run, in order, each with how many queued jobs it stands
/// for (`jobs` are counted already): a task absorbs the tasks behind it
/// that it can (see [`Task::absorb`]).
pub(crate) fn merge(jobs: impl Iterator<Item = (Job, usize)>) -> Vec<(Job, usize)> {
    let mut out: Vec<(Job, usize)> = Vec::new();
    for (job, count) in jobs {
        let Job::Task(next) = job else {
            out.push((job, count));
            continue;
        };
        let next = match out.last_mut() {
            Some((Job::Task(last), n)) => match last.absorb(next) {
                Ok(()) => {
                    *n += count;
                    continue;
                }
                Err(next) => next,
            },
            _ => next,
        };
        out.push((Job::Task(next), count));
    }
    out
}

/// Jobs submitted while a `Hold` lives wait; the worker takes them
/// together when it drops (see [`Context::hold`](super::Context::hold)).
pub struct Hold {
    pub(super) _release: Sender<()>,
}
