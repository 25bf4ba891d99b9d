//! The flat API: llama.cpp's own model of a context, for callers who
//! manage sequence ids themselves. `decode` decodes into the sequence a
//! caller names and keeps the context's last logits and its sampler; `kv`
//! removes, copies, keeps, clears, saves, loads and reseeds sequences.
//! Sequences leased by branches are off limits here (branches manage their
//! own KV).

mod decode;
pub(crate) mod kv;
