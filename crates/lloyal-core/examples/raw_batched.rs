//! The baseline for `bench/branching.py`: N sequences decoded in lockstep
//! with plain llama-cpp-2 calls. Prefills a shared prompt into sequence 0,
//! copies it to sequences 1..N, then each step decodes one token per
//! sequence in a single `llama_decode` and picks each next token greedily.
//!
//! ```text
//! cargo run --example raw_batched -- MODEL.gguf TOKENS.json N STEPS N_THREADS N_CTX
//! ```
//!
//! With `STEPS` = 0 it serves chunks instead: each line on stdin is a number
//! of steps to run, continuing where the last chunk stopped, answered by one
//! JSON line with their wall time. `bench/branching.py` alternates these
//! chunks with chunks of the Python loop, so both sides see the same
//! machine.

use std::num::NonZeroU32;
use std::time::Instant;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

fn argmax(logits: &[f32]) -> i32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as i32
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 7 {
        return Err("usage: raw_batched MODEL TOKENS.json N STEPS N_THREADS N_CTX".into());
    }
    let prompt: Vec<i32> = serde_json::from_str(&std::fs::read_to_string(&args[2])?)?;
    let n: usize = args[3].parse()?;
    let steps: usize = args[4].parse()?;
    let n_threads: i32 = args[5].parse()?;
    let n_ctx: u32 = args[6].parse()?;

    llama_cpp_2::send_logs_to_tracing(llama_cpp_2::LogOptions::default().with_logs_enabled(false));
    let backend = LlamaBackend::init()?;
    let model = LlamaModel::load_from_file(&backend, &args[1], &LlamaModelParams::default())?;
    let n_batch = 512u32;
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(n_ctx))
        .with_n_batch(n_batch)
        .with_n_ubatch(n_batch)
        .with_n_seq_max(u32::try_from(n)?)
        .with_n_threads(n_threads)
        .with_n_threads_batch(n_threads)
        .with_kv_unified(true)
        .with_swa_full(true);
    let mut ctx = model.new_context(&backend, params)?;
    let mut batch = LlamaBatch::new(n_batch as usize, 1);

    for (i, &t) in prompt.iter().enumerate() {
        batch.add(LlamaToken(t), i as i32, &[0], i + 1 == prompt.len())?;
    }
    ctx.decode(&mut batch)?;
    let first = argmax(ctx.get_logits_ith(batch.n_tokens() - 1));
    for seq in 1..n as i32 {
        ctx.copy_kv_cache_seq(0, seq, None, None)?;
    }
    let mut next = vec![first; n];
    let mut pos = prompt.len() as i32;
    let mut run = |steps: usize| -> Result<f64, Box<dyn std::error::Error>> {
        let started = Instant::now();
        for _ in 0..steps {
            batch.clear();
            for (seq, &t) in next.iter().enumerate() {
                batch.add(LlamaToken(t), pos, &[seq as i32], true)?;
            }
            ctx.decode(&mut batch)?;
            for (row, t) in next.iter_mut().enumerate() {
                *t = argmax(ctx.get_logits_ith(row as i32));
            }
            pos += 1;
        }
        Ok(started.elapsed().as_secs_f64())
    };
    if steps > 0 {
        let seconds = run(steps)?;
        println!(
            "{}",
            serde_json::json!({"branches": n, "steps": steps, "seconds": seconds})
        );
        return Ok(());
    }
    for line in std::io::stdin().lines() {
        let chunk: usize = line?.trim().parse()?;
        let seconds = run(chunk)?;
        println!(
            "{}",
            serde_json::json!({"branches": n, "steps": chunk, "seconds": seconds})
        );
    }
    Ok(())
}
