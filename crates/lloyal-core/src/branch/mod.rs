//! Branches: forkable decode state.
//!
//! A branch's data and the arena that holds it are in `crate::state`; this
//! folder holds the operations on them, and [`Branch`] (`handle`), the
//! owned handle whose drop frees an unpruned branch and which owns every
//! one-branch verb. `api` holds their bodies (`pub(crate)`, by id) and the
//! verbs of many branches. Cheap, decode-free operations (create, produce, accept, reading state) run on the caller's thread
//! under the `branches` lock; anything touching the KV cache is a job for
//! the worker (`job`), or a step (`batch` starts commits and prefills, and
//! produces for many branches at once), whose branches are marked busy from
//! submission until it finishes, so a second operation on one of them fails
//! with `BranchBusy` instead of interleaving. The engine runs the steps'
//! rounds (`engine::rounds`), where continuous tree batching happens:
//! tokens of many branches -- different sequences, different positions,
//! each needing its own logits -- share one `llama_decode`. `tree`
//! prefills a token tree in one decode; `ops` forks, prunes, reseeds and
//! truncates; `snapshot` saves and restores.

mod api;
mod batch;
mod handle;
mod job;
mod ops;
mod snapshot;
mod tree;

pub use handle::Branch;
pub use tree::TreeOutcome;
