//! Setup shared by the baseline examples: a plain llama-cpp-2 context
//! configured like lloyal's, its prefill and lockstep step, and a blocking
//! wait for engine replies. Each baseline keeps its timed loop in its own
//! file. (Not an example itself: cargo only builds `examples/*/main.rs`.)
#![allow(dead_code)] // each example uses part of this

use std::num::NonZeroU32;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::token::LlamaToken;

pub type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Initialise llama.cpp with its log silenced (for baselines that run
/// without lloyal's engine; those beside it take `lloyal_core::backend()`).
pub fn init_backend() -> AnyResult<LlamaBackend> {
    llama_cpp_2::send_logs_to_tracing(llama_cpp_2::LogOptions::default().with_logs_enabled(false));
    Ok(LlamaBackend::init()?)
}

/// Context parameters as lloyal sets them: unified KV, a full-size
/// sliding-window cache, `n_ubatch = n_batch`.
pub fn raw_params(n_ctx: u32, n_batch: u32, n_seq_max: u32, n_threads: i32) -> LlamaContextParams {
    LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(n_ctx))
        .with_n_batch(n_batch)
        .with_n_ubatch(n_batch)
        .with_n_seq_max(n_seq_max)
        .with_n_threads(n_threads)
        .with_n_threads_batch(n_threads)
        .with_kv_unified(true)
        .with_swa_full(true)
}

/// A JSON array of token ids, read from `path`.
pub fn read_tokens(path: &str) -> AnyResult<Vec<i32>> {
    Ok(serde_json::from_str(&std::fs::read_to_string(path)?)?)
}

pub fn argmax(logits: &[f32]) -> i32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as i32
}

/// Decode `tokens` into sequence 0 from position 0, in chunks of the
/// batch's capacity `n_batch`; returns the greedy next token.
pub fn prefill(
    ctx: &mut LlamaContext<'_>,
    batch: &mut LlamaBatch<'_>,
    n_batch: usize,
    tokens: &[i32],
) -> AnyResult<i32> {
    for (c, chunk) in tokens.chunks(n_batch).enumerate() {
        batch.clear();
        for (j, &t) in chunk.iter().enumerate() {
            let pos = c * n_batch + j;
            batch.add(LlamaToken(t), pos as i32, &[0], pos + 1 == tokens.len())?;
        }
        ctx.decode(batch)?;
    }
    Ok(argmax(ctx.get_logits_ith(batch.n_tokens() - 1)))
}

/// One lockstep step: `next[s]` decoded into sequence `s` at `pos`, all in
/// one `llama_decode`, then replaced by each row's greedy token.
pub fn lockstep_step(
    ctx: &mut LlamaContext<'_>,
    batch: &mut LlamaBatch<'_>,
    next: &mut [i32],
    pos: i32,
) -> AnyResult<()> {
    batch.clear();
    for (seq, &t) in next.iter().enumerate() {
        batch.add(LlamaToken(t), pos, &[seq as i32], true)?;
    }
    ctx.decode(batch)?;
    for (row, t) in next.iter_mut().enumerate() {
        *t = argmax(ctx.get_logits_ith(row as i32));
    }
    Ok(())
}

/// Start an engine operation and block until its reply.
pub fn wait<T: Send + 'static>(
    start: impl FnOnce(lloyal_core::Reply<T>),
) -> lloyal_core::Result<T> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    start(lloyal_core::Reply::new(move |r| {
        let _ = tx.send(r);
    }));
    rx.recv().map_err(|_| lloyal_core::Error::ContextClosed)?
}

/// An engine context for lockstep runs (2 threads, a lease for each of `n`
/// forks and their root), the 128-token prompt the examples decode, and `n`
/// greedy forks of a root prefilled with it.
pub fn engine_forks(
    path: &str,
    n: usize,
    n_ctx: u32,
) -> AnyResult<(
    std::sync::Arc<lloyal_core::Context>,
    Vec<i32>,
    Vec<lloyal_core::Branch>,
)> {
    let ctx = std::sync::Arc::new(lloyal_core::Context::open_blocking(
        path,
        lloyal_core::ContextParams {
            n_ctx,
            n_seq_max: n as u32 + 1,
            n_threads: Some(2),
            ..lloyal_core::ContextParams::default()
        },
    )?);
    let text = "The history of the printing press begins ".repeat(20);
    let prompt: Vec<i32> = ctx.model().tokenize(&text, None, false)?[..128].to_vec();
    let root = lloyal_core::Branch::create(&ctx, lloyal_core::SamplingParams::greedy())?;
    wait(|r| ctx.branch_prefill(vec![(root.id(), prompt.clone())], false, r))?;
    let kids = (0..n)
        .map(|_| root.fork(None))
        .collect::<lloyal_core::Result<_>>()?;
    Ok((ctx, prompt, kids))
}

/// One engine lockstep step: each branch produces its token, and all are
/// committed in one batch.
pub fn engine_step(
    ctx: &lloyal_core::Context,
    branches: &[lloyal_core::Branch],
) -> lloyal_core::Result<()> {
    let items = branches
        .iter()
        .map(|b| Ok((b.id(), b.produce()?)))
        .collect::<lloyal_core::Result<Vec<_>>>()?;
    for result in wait(|r| ctx.branch_commit(items, r))? {
        result?;
    }
    Ok(())
}
