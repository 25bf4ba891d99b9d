//! The flat API's decoding: into sequence ids the caller chooses, the
//! context's last logits and its own sampler.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::engine::{Context, Job, Reply, Task, Worker};
use crate::error::{invalid, Error, Result};
use crate::metrics::{self, Base};
use crate::sampling::{Sampler, SamplingParams};
use crate::sync::lock;

impl Context {
    /// Decode `tokens` into sequence `seq` starting at `pos`, which must
    /// continue the sequence (`kv_seq_pos_max(seq) + 1`). Inputs longer than
    /// `n_batch` are split across several `llama_decode` calls; if any of
    /// them fails, what this call added to the KV cache is removed again.
    pub fn decode(&self, tokens: Vec<i32>, pos: i32, seq: i32, reply: Reply<()>) {
        self.submit(Job::task(DecodeJob {
            tokens,
            pos,
            seq,
            reply,
        }));
    }

    /// Blocking [`Context::decode`].
    pub fn decode_blocking(&self, tokens: Vec<i32>, pos: i32, seq: i32) -> Result<()> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.decode(
            tokens,
            pos,
            seq,
            Reply::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv().map_err(|_| Error::ContextClosed)?
    }

    /// Largest position held for `seq` (`-1` when empty).
    pub fn kv_seq_pos_max(&self, seq: i32) -> Result<i32> {
        self.check_open()?;
        let slot = self.seq_slot(seq)?;
        Ok(self.shared.pos_max[slot].load(Ordering::Acquire))
    }

    fn seq_slot(&self, seq: i32) -> Result<usize> {
        self.shared.seq_slot(seq)
    }

    /// A copy of the last decoded token's logits.
    pub fn logits(&self) -> Result<Arc<[f32]>> {
        self.check_open()?;
        lock(&self.shared.logits)
            .clone()
            .ok_or_else(|| invalid("no logits yet: decode at least one token first"))
    }

    /// Sample from `logits` (or the context's last logits) with the flat
    /// loop's persistent sampler, reconfigured to `params` when they differ.
    /// The sampled token enters the sampler's penalty history.
    pub fn sample(&self, params: &SamplingParams, logits: Option<&[f32]>) -> Result<i32> {
        self.check_open()?;
        let current;
        let logits = match logits {
            Some(l) => {
                self.check_logits_len(l)?;
                l
            }
            None => {
                current = self.logits()?;
                &current
            }
        };
        let mut guard = lock(&self.shared.sampler);
        let sampler = match guard.as_mut() {
            Some(s) => {
                if s.params() != params {
                    s.set_params(params.clone())?;
                    self.model().bind_sampler(s);
                }
                s
            }
            None => {
                let s = guard.insert(Sampler::new(params.clone())?);
                self.model().bind_sampler(s);
                s
            }
        };
        sampler.sample(logits)
    }

    /// The most likely next token under the last logits (plain argmax).
    pub fn greedy_sample(&self) -> Result<i32> {
        let logits = self.logits()?;
        crate::sampling::greedy(&logits)
            .ok_or_else(|| invalid("every logit is -inf or NaN: nothing can be sampled"))
    }

    /// Forget the flat sampler's penalty history (and its RNG state).
    pub fn reset_sampler(&self) {
        *lock(&self.shared.sampler) = None;
    }

    pub fn check_logits_len(&self, logits: &[f32]) -> Result<()> {
        let n = self.model().vocab_size() as usize;
        if logits.len() != n {
            return Err(invalid(format!(
                "logits must have shape ({n},), got ({},)",
                logits.len()
            )));
        }
        Ok(())
    }

    fn logits_or_current(&self, logits: Option<&[f32]>) -> Result<Arc<[f32]>> {
        match logits {
            Some(l) => {
                self.check_logits_len(l)?;
                Ok(Arc::from(l))
            }
            None => self.logits(),
        }
    }

    pub fn model_entropy(&self, base: Base, logits: Option<&[f32]>) -> Result<f64> {
        metrics::entropy(&self.logits_or_current(logits)?, base)
    }

    pub fn model_surprisal(&self, token: i32, base: Base, logits: Option<&[f32]>) -> Result<f64> {
        self.model().check_token(token)?;
        metrics::surprisal(&self.logits_or_current(logits)?, token, base)
    }
}

/// [`Context::decode`] on the worker.
struct DecodeJob {
    tokens: Vec<i32>,
    pos: i32,
    seq: i32,
    reply: Reply<()>,
}

impl Task for DecodeJob {
    fn run(self: Box<Self>, worker: &mut Worker<'_>) {
        let result = worker.decode(&self.tokens, self.pos, self.seq);
        self.reply.send(result);
    }

    fn fail(self: Box<Self>, error: crate::error::Error) {
        self.reply.send(Err(error));
    }
}
