//! Token sampling on a logits slice, in plain Rust so that a sampler (its
//! parameters, penalty history and RNG state) is ordinary data that clones
//! when a branch forks.
//!
//! The chain follows llama.cpp's default order: penalties, top-k, typical-p,
//! top-p, min-p, temperature, then a draw from the softmax. A temperature of
//! zero or below is greedy (argmax after penalties).
//!
//! `params` holds the parameters and their checks, `chain` the sampler.

mod chain;
mod params;
#[cfg(test)]
mod tests;

pub use chain::{greedy, Sampler};
pub use params::SamplingParams;
