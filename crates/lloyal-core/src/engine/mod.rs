//! The engine: a llama.cpp context driven by one worker thread.
//!
//! llama.cpp contexts are not thread-safe, so the worker thread owns the
//! context and its batch; everything else sends it jobs over a tokio
//! channel and gets the result through a [`Reply`]. The worker drains
//! whatever is pending before it runs, so bursts of requests are handled
//! together: every decode of branch tokens is a `step`, and the steps
//! queued back to back run as one, in rounds of one decode each (commits
//! of many callers and chunks of prompts share a decode). Cheap reads (the last logits,
//! positions, statistics) are mirrored into `Shared` so callers never wait
//! behind a running decode to read them.
//!
//! Short jobs (fork, prune) can also run on the caller's thread when the
//! worker is idle: nothing queued, nothing running (see
//! `Context::run_inline`). The worker state sits behind a mutex for that;
//! the worker thread holds it while it runs a job, so the context is still
//! used by one thread at a time, and in submission order.
//!
//! Layers: the engine uses the leaf modules (model, params, sampling,
//! metrics, grammar) and `state` (the branch arena it guards, and whose
//! branches its steps decode into); `branch`, `flat`, `embed` and `aio`
//! use the engine, never the other way round: their work reaches the
//! worker as a `Task` or a step.
//!
//! Files: `handle` (the `Context` handle: submit, inline, hold, close),
//! `start` (loading, creating the llama.cpp context, the worker thread),
//! `run` (the worker's loop), `worker` (the decode primitives), `job` (the
//! jobs and the `Task` trait other modules implement), `step` (the one
//! batching mechanism: groups of commits and prefills, their failure
//! rules), `rounds` (a step's rounds: one decode each, the undo of a
//! failed group), `scan` (logits rows copied and scanned on OpenMP
//! threads), `reply`, `shared`. No engine file uses `crate::branch`.

mod adapters;
mod handle;
mod job;
mod reply;
mod rounds;
mod run;
mod scan;
mod shared;
mod start;
pub(crate) mod step;
mod worker;

pub use handle::{join_workers, Context, WORKER_THREAD_NAME};
pub use job::Hold;
pub use reply::{after_job, Reply};
pub(crate) use reply::{panic_text, unanswered};
pub use shared::{Embeddings, Stats};
pub use step::{Input as StepInput, ItemResults, StepGroup};

pub(crate) use job::{Job, Recover, Task};
pub(crate) use shared::Shared;
pub(crate) use worker::Worker;
