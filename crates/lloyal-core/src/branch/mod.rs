//! Branches: forkable decode state.
//!
//! `state` holds a branch's data (sampler, logits snapshot, metrics,
//! grammar) and the arena of branches with its KV leases; the rest are the
//! operations. `api` is what a caller starts: cheap, decode-free operations
//! (create, produce, accept, reading state) run on the caller's thread
//! under the `branches` lock; anything touching the KV cache is a job for
//! the worker (`job`), or a step (`batch` starts commits and prefills, and
//! produces for many branches at once), whose branches are marked busy from
//! submission until it finishes, so a second operation on one of them fails
//! with `BranchBusy` instead of interleaving. `decode` runs the steps'
//! rounds, where continuous tree batching happens: tokens of many branches
//! -- different sequences, different positions, each needing its own
//! logits -- share one
//! `llama_decode`; `tree` prefills a token tree in one decode; `ops` forks,
//! prunes, reseeds and truncates; `snapshot` saves and restores; `scan` is
//! the OpenMP assist that copies and scans logits rows; `view` reads the
//! next-token distribution (top tokens, log-probabilities) without the lock.

mod api;
mod batch;
mod decode;
mod job;
mod ops;
mod scan;
mod snapshot;
pub(crate) mod state;
mod tree;
mod view;

pub use state::{BranchId, BranchState, Branches};
pub use tree::TreeOutcome;
pub use view::LogitsView;
