//! Embeddings on a context created with `embeddings = true`.
//!
//! `embed` runs many inputs through as few `llama_decode` calls as the batch
//! allows: each input gets its own KV sequence (borrowed from the free
//! leases for the duration of the call), whole inputs are packed into a
//! batch up to `n_batch` tokens, and every borrowed sequence is cleared
//! again afterwards. `encode` runs one input and keeps its embeddings as the
//! context's current ones (`embeddings()`), pooled or per token.

use crate::engine::{Context, Embeddings, Job, Reply, Task, Worker};
use crate::error::{invalid, Error, Result};
use crate::params::Pooling;
use crate::sync::lock;

use llama_cpp_2::token::LlamaToken;

pub(crate) enum EmbedJob {
    Embed {
        inputs: Vec<Vec<i32>>,
        reply: Reply<Vec<Vec<f32>>>,
    },
    Encode {
        tokens: Vec<i32>,
        reply: Reply<()>,
    },
}

impl EmbedJob {
    pub(crate) fn fail(self, error: Error) {
        match self {
            EmbedJob::Embed { reply, .. } => reply.send(Err(error)),
            EmbedJob::Encode { reply, .. } => reply.send(Err(error)),
        }
    }
}

impl Task for EmbedJob {
    fn run(self: Box<Self>, worker: &mut Worker<'_>) {
        worker.execute_embed(*self);
    }

    fn fail(self: Box<Self>, error: Error) {
        EmbedJob::fail(*self, error);
    }
}

impl Context {
    /// Whether this is a reranker's context (rank pooling): each input
    /// gives [`Model::n_cls_out`](crate::Model::n_cls_out) scores.
    pub fn ranks(&self) -> bool {
        let p = self.params();
        p.embeddings && p.pooling == Pooling::Rank
    }

    /// Whether this is an embedding context that pools (mean, cls or last).
    pub fn has_pooling(&self) -> bool {
        let p = self.params();
        p.embeddings && matches!(p.pooling, Pooling::Mean | Pooling::Cls | Pooling::Last)
    }

    fn check_embedding_context(&self, pooled: bool) -> Result<()> {
        let params = self.params();
        if !params.embeddings {
            return Err(invalid(
                "this context computes logits, not embeddings: create it with embeddings=True",
            ));
        }
        if params.pooling == Pooling::Rank && !self.model().is_reranker() {
            return Err(invalid(
                "rank pooling needs a reranker (a GGUF with a classification head and \
                 rank pooling); use mean, cls or last for embeddings",
            ));
        }
        if pooled && params.pooling == Pooling::None {
            return Err(invalid(
                "embed() needs a pooled context (pooling mean, cls or last); with pooling \
                 none use encode() and get_embeddings() for per-token vectors",
            ));
        }
        Ok(())
    }

    fn check_input(&self, tokens: &[i32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(invalid("cannot embed an empty input"));
        }
        self.model().check_tokens(tokens)?;
        let n_batch = self.params().n_batch as usize;
        if tokens.len() > n_batch {
            return Err(invalid(format!(
                "an input of {} tokens does not fit one batch (n_batch={n_batch}); \
                 create the context with a larger n_batch",
                tokens.len()
            )));
        }
        Ok(())
    }

    /// Pooled embeddings of each input, in order.
    pub fn embed(&self, inputs: Vec<Vec<i32>>, reply: Reply<Vec<Vec<f32>>>) {
        let checked = self
            .check_embedding_context(true)
            .and_then(|()| inputs.iter().try_for_each(|t| self.check_input(t)));
        match checked {
            Err(e) => reply.send(Err(e)),
            Ok(()) if inputs.is_empty() => reply.send(Ok(Vec::new())),
            Ok(()) => self.submit(Job::task(EmbedJob::Embed { inputs, reply })),
        }
    }

    /// Run `tokens` through the model and keep their embeddings as the
    /// current ones (see [`Context::embeddings`]).
    pub fn encode(&self, tokens: Vec<i32>, reply: Reply<()>) {
        match self
            .check_embedding_context(false)
            .and_then(|()| self.check_input(&tokens))
        {
            Err(e) => reply.send(Err(e)),
            Ok(()) => self.submit(Job::task(EmbedJob::Encode { tokens, reply })),
        }
    }

    /// The embeddings of the last `encode`.
    pub fn embeddings(&self) -> Result<Embeddings> {
        lock(&self.shared.embeddings)
            .clone()
            .ok_or_else(|| invalid("no embeddings yet: call encode() first"))
    }
}

impl Worker<'_> {
    pub(crate) fn execute_embed(&mut self, job: EmbedJob) {
        match job {
            EmbedJob::Embed { inputs, reply } => {
                let result = self.embed(&inputs);
                reply.send(result);
            }
            EmbedJob::Encode { tokens, reply } => {
                let result = self.encode(&tokens);
                reply.send(result);
            }
        }
    }

    /// Borrow up to `want` free sequences (never one the flat API holds
    /// cells in).
    fn borrow_seqs(&mut self, want: usize) -> Result<Vec<i32>> {
        let shared = std::sync::Arc::clone(&self.shared);
        let mut branches = lock(&shared.branches);
        let mut seqs = Vec::new();
        while seqs.len() < want {
            let Ok(seq) = branches.lease(|s| shared.holds_flat_data(s)) else {
                break;
            };
            seqs.push(seq);
        }
        if seqs.is_empty() {
            return Err(Error::NoLease(
                "embedding needs a free KV sequence, and every one is held by a branch \
                 or holds flat-API cells; prune a branch or remove those cells"
                    .to_owned(),
            ));
        }
        Ok(seqs)
    }

    fn return_seqs(&mut self, seqs: Vec<i32>) {
        let mut branches = lock(&self.shared.branches);
        for seq in seqs {
            let _ = self.ctx.kv_cache_seq_rm(seq, None, None);
            self.refresh_pos(seq as usize, seq);
            branches.release(seq);
        }
    }

    fn embed(&mut self, inputs: &[Vec<i32>]) -> Result<Vec<Vec<f32>>> {
        let seqs = self.borrow_seqs(inputs.len())?;
        let result = self.embed_with(inputs, &seqs);
        self.return_seqs(seqs);
        result
    }

    /// Pack whole inputs into batches of at most `n_batch` tokens and one
    /// borrowed sequence each; read each input's pooled vector.
    fn embed_with(&mut self, inputs: &[Vec<i32>], seqs: &[i32]) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(inputs.len());
        let mut start = 0;
        while start < inputs.len() {
            let mut end = start;
            let mut tokens = 0;
            while end < inputs.len()
                && end - start < seqs.len()
                && tokens + inputs[end].len() <= self.n_batch
            {
                tokens += inputs[end].len();
                end += 1;
            }
            self.batch.clear();
            for (input, &seq) in inputs[start..end].iter().zip(seqs) {
                let _ = self.ctx.kv_cache_seq_rm(seq, None, None);
                for (pos, &t) in input.iter().enumerate() {
                    self.batch
                        .add(LlamaToken(t), pos as i32, &[seq], true)
                        .map_err(|e| Error::Internal(format!("batch add: {e}")))?;
                }
            }
            self.use_default_adapters()?;
            self.llama_decode(tokens)?;
            let mut row = 0;
            for (input, &seq) in inputs[start..end].iter().zip(seqs) {
                out.push(self.pooled(seq, row, input.len())?);
                row += input.len();
            }
            start = end;
        }
        Ok(out)
    }

    fn encode(&mut self, tokens: &[i32]) -> Result<()> {
        let seqs = self.borrow_seqs(1)?;
        let result = self.encode_with(tokens, seqs[0]);
        self.return_seqs(seqs);
        let embeddings = result?;
        *lock(&self.shared.embeddings) = Some(embeddings);
        Ok(())
    }

    fn encode_with(&mut self, tokens: &[i32], seq: i32) -> Result<Embeddings> {
        self.batch.clear();
        for (pos, &t) in tokens.iter().enumerate() {
            self.batch
                .add(LlamaToken(t), pos as i32, &[seq], true)
                .map_err(|e| Error::Internal(format!("batch add: {e}")))?;
        }
        self.use_default_adapters()?;
        self.llama_decode(tokens.len())?;
        if self.params.pooling == Pooling::None {
            let mut data = Vec::new();
            for row in 0..tokens.len() {
                let v = self
                    .ctx
                    .embeddings_ith(row as i32)
                    .map_err(|e| Error::Internal(format!("token embeddings: {e}")))?;
                data.extend_from_slice(v);
            }
            let dim = data.len() / tokens.len();
            Ok(Embeddings {
                rows: tokens.len(),
                dim,
                data,
            })
        } else {
            let v = self.pooled(seq, 0, tokens.len())?;
            Ok(Embeddings {
                rows: 1,
                dim: v.len(),
                data: v,
            })
        }
    }

    /// The pooled vector of `seq`, whose tokens are batch rows `first..first
    /// + n`: llama.cpp's, or the mean of the rows in order
    /// (`ContextParams::pools_in_rust`).
    fn pooled(&self, seq: i32, first: usize, n: usize) -> Result<Vec<f32>> {
        if !self.params.pools_in_rust() {
            let v = self
                .ctx
                .embeddings_seq_ith(seq)
                .map_err(|e| Error::Internal(format!("pooled embeddings: {e}")))?;
            return Ok(v.to_vec());
        }
        let mut sum: Vec<f64> = Vec::new();
        for row in first..first + n {
            let v = self
                .ctx
                .embeddings_ith(row as i32)
                .map_err(|e| Error::Internal(format!("token embeddings: {e}")))?;
            sum.resize(v.len(), 0.0);
            for (s, &x) in sum.iter_mut().zip(v) {
                *s += f64::from(x);
            }
        }
        Ok(sum.into_iter().map(|s| (s / n as f64) as f32).collect())
    }
}
