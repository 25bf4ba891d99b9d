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

use std::time::Instant;

use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;

mod common;
use common::{init_backend, lockstep_step, prefill, raw_params, read_tokens, AnyResult};

fn main() -> AnyResult<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 7 {
        return Err("usage: raw_batched MODEL TOKENS.json N STEPS N_THREADS N_CTX".into());
    }
    let prompt = read_tokens(&args[2])?;
    let n: usize = args[3].parse()?;
    let steps: usize = args[4].parse()?;
    let n_threads: i32 = args[5].parse()?;
    let n_ctx: u32 = args[6].parse()?;

    let backend = init_backend()?;
    let model = LlamaModel::load_from_file(&backend, &args[1], &LlamaModelParams::default())?;
    let n_batch = 512;
    let params = raw_params(n_ctx, n_batch, u32::try_from(n)?, n_threads);
    let mut ctx = model.new_context(&backend, params)?;
    let mut batch = LlamaBatch::new(n_batch as usize, 1);
    let first = prefill(&mut ctx, &mut batch, n_batch as usize, &prompt)?;
    for seq in 1..n as i32 {
        ctx.copy_kv_cache_seq(0, seq, None, None)?;
    }
    let mut next = vec![first; n];
    let mut pos = prompt.len() as i32;
    let mut run = |steps: usize| -> AnyResult<f64> {
        let started = Instant::now();
        for _ in 0..steps {
            lockstep_step(&mut ctx, &mut batch, &mut next, pos)?;
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
