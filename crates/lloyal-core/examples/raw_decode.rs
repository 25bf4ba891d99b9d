//! The baseline for `bench/decode.py`: a plain llama-cpp-2 loop with no
//! lloyal code in it. Prefills the given prompt in one `llama_decode`, then
//! decodes greedily one token at a time, and prints timings as JSON.
//!
//! ```text
//! cargo run --example raw_decode -- MODEL.gguf TOKENS.json N_GEN N_THREADS N_CTX
//! ```
//! `TOKENS.json` is a JSON array of prompt token ids.

use std::num::NonZeroU32;
use std::time::Instant;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 6 {
        return Err("usage: raw_decode MODEL TOKENS.json N_GEN N_THREADS N_CTX".into());
    }
    let prompt: Vec<i32> = serde_json::from_str(&std::fs::read_to_string(&args[2])?)?;
    let n_gen: usize = args[3].parse()?;
    let n_threads: i32 = args[4].parse()?;
    let n_ctx: u32 = args[5].parse()?;

    llama_cpp_2::send_logs_to_tracing(llama_cpp_2::LogOptions::default().with_logs_enabled(false));
    let backend = LlamaBackend::init()?;
    let model = LlamaModel::load_from_file(&backend, &args[1], &LlamaModelParams::default())?;
    let n_batch = u32::try_from(prompt.len().max(1))?.max(512);
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(n_ctx))
        .with_n_batch(n_batch)
        .with_n_ubatch(n_batch)
        .with_n_threads(n_threads)
        .with_n_threads_batch(n_threads)
        .with_kv_unified(true)
        .with_swa_full(true);
    let mut ctx = model.new_context(&backend, params)?;
    let mut batch = LlamaBatch::new(n_batch as usize, 1);

    let started = Instant::now();
    for (i, &t) in prompt.iter().enumerate() {
        batch.add(LlamaToken(t), i as i32, &[0], i + 1 == prompt.len())?;
    }
    ctx.decode(&mut batch)?;
    let prefill_s = started.elapsed().as_secs_f64();

    let argmax = |logits: &[f32]| {
        let mut best = 0;
        for (i, &l) in logits.iter().enumerate() {
            if l > logits[best] {
                best = i;
            }
        }
        best as i32
    };
    let mut next = argmax(ctx.get_logits_ith(batch.n_tokens() - 1));
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
