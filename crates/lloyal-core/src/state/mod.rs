//! Branch state: the data a branch is (`branch`), the arena of a context's
//! branches with their KV leases (`arena`), and reading a branch's
//! next-token distribution without the arena's lock (`view`). No operations
//! live here: the engine guards this data and runs steps over it, and
//! `branch` holds what callers do to it.

mod arena;
mod branch;
mod id;
mod view;

pub use arena::Branches;
pub use branch::BranchState;
pub use id::BranchId;
pub use view::LogitsView;
