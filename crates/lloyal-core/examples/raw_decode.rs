//! The baseline for `bench/decode.py`: a plain llama-cpp-2 loop with no
//! lloyal code in it. Prefills the given prompt in one `llama_decode`, then
//! decodes greedily one token at a time, and prints timings as JSON.
//!
//! ```text
//! cargo run --example raw_decode -- MODEL.gguf TOKENS.json N_GEN N_THREADS N_CTX
//! ```
//! `TOKENS.json` is a JSON array of prompt token ids.

use std::time::Instant;

use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

mod common;
use common::{argmax, init_backend, prefill, raw_params, read_tokens, AnyResult};

fn main() -> AnyResult<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 6 {
        return Err("usage: raw_decode MODEL TOKENS.json N_GEN N_THREADS N_CTX".into());
    }
    let prompt = read_tokens(&args[2])?;
    let n_gen: usize = args[3].parse()?;
    let n_threads: i32 = args[4].parse()?;
    let n_ctx: u32 = args[5].parse()?;

    let backend = init_backend()?;
    let model = LlamaModel::load_from_file(&backend, &args[1], &LlamaModelParams::default())?;
    // One batch holds the whole prompt, so the prefill is one llama_decode.
    let n_batch = u32::try_from(prompt.len().max(1))?.max(512);
    let mut ctx = model.new_context(&backend, raw_params(n_ctx, n_batch, 1, n_threads))?;
    let mut batch = LlamaBatch::new(n_batch as usize, 1);

    let started = Instant::now();
    let mut next = prefill(&mut ctx, &mut batch, n_batch as usize, &prompt)?;
    let prefill_s = started.elapsed().as_secs_f64();

    let mut generated = Vec::with_capacity(n_gen);
    let started = Instant::now();
    for i in 0..n_gen {
        generated.push(next);
        batch.clear();
        batch.add(LlamaToken(next), (prompt.len() + i) as i32, &[0], true)?;
        ctx.decode(&mut batch)?;
        next = argmax(ctx.get_logits_ith(0));
    }
    let decode_s = started.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({
            "prefill_tokens": prompt.len(),
            "prefill_s": prefill_s,
            "decode_tokens": n_gen,
            "decode_s": decode_s,
            "generated": generated,
        })
    );
    Ok(())
}
