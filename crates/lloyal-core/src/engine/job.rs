//! Jobs: what callers send the worker. The engine's own jobs are variants:
//! steps (see `step`), the close and the test device `Hold`. Everything
//! else -- branch operations, the flat API, embeddings -- is a [`Task`]
//! that the module doing it defines, so the engine knows nothing of it
//! beyond this trait.

use crossbeam_channel::{Receiver, Sender};

use super::reply::Reply;
use super::step::Step;
use super::worker::Worker;
use crate::error::Error;
use crate::state::BranchId;

pub(crate) enum Job {
    /// Branch tokens to decode: commits and prefills (see `step`).
    Step(Step),
    /// Work another module defines (branches, the flat API, embeddings).
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

/// A job another module defines. The worker runs it (or fails it, when the
/// context closes first); its replies answer its callers.
pub(crate) trait Task: Send + 'static {
    /// Run on the worker, holding it.
    fn run(self: Box<Self>, worker: &mut Worker<'_>);

    /// Answer every caller with `error` without running.
    fn fail(self: Box<Self>, error: Error);

    /// Whether this job may run between two rounds of the step in
    /// progress, ahead of it (see `run`): it touches none of `step`'s
    /// branches and decodes nothing. Jobs that do not say so wait until
    /// the step has finished.
    fn overtakes(&self, _worker: &Worker<'_>, _step: &[BranchId]) -> bool {
        false
    }

    /// What the worker must put right if `run` panics (the replies have
    /// answered already, see `Reply`); asked before `run`.
    fn recover(&self) -> Option<Recover> {
        None
    }
}

impl Job {
    pub(crate) fn task(task: impl Task) -> Job {
        Job::Task(Box::new(task))
    }

    pub(crate) fn fail(self, error: Error) {
        match self {
            Job::Close { reply } => reply.send(Err(error)),
            Job::Step(step) => step.fail(error),
            Job::Task(task) => task.fail(error),
            Job::Hold { .. } => {}
        }
    }
}

/// Jobs submitted while a `Hold` lives wait; the worker takes them
/// together when it drops (see [`Context::hold`](super::Context::hold)).
/// A test device: batching does not use it.
pub struct Hold {
    pub(super) _release: Sender<()>,
}
