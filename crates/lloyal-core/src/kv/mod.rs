//! The KV cache: the flat API's operations on sequence ids (`flat`) and
//! saved state framing (`state`), which branch snapshots use too.

pub(crate) mod flat;
pub(crate) mod state;
