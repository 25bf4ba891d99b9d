//! The baseline for fork latency in `bench/branching.py`: llama.cpp's own
//! KV sequence copy (`llama_memory_seq_cp`, unified KV) of a prefilled
//! prefix, timed with plain llama-cpp-2 calls. Prints the median of
//! `REPEATS` copies (each followed by clearing the copy, untimed).
//!
//! ```text
//! cargo run --example raw_seq_copy -- MODEL.gguf TOKENS.json N_CTX N_THREADS REPEATS
//! ```

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
        return Err("usage: raw_seq_copy MODEL TOKENS.json N_CTX N_THREADS REPEATS".into());
    }
    let prefix: Vec<i32> = serde_json::from_str(&std::fs::read_to_string(&args[2])?)?;
    let n_ctx: u32 = args[3].parse()?;
    let n_threads: i32 = args[4].parse()?;
    let repeats: usize = args[5].parse()?;

    llama_cpp_2::send_logs_to_tracing(llama_cpp_2::LogOptions::default().with_logs_enabled(false));
    let backend = LlamaBackend::init()?;
    let model = LlamaModel::load_from_file(&backend, &args[1], &LlamaModelParams::default())?;
    let n_batch = 512u32;
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(n_ctx))
        .with_n_batch(n_batch)
        .with_n_ubatch(n_batch)
        .with_n_seq_max(2)
        .with_n_threads(n_threads)
        .with_n_threads_batch(n_threads)
        .with_kv_unified(true)
        .with_swa_full(true);
    let mut ctx = model.new_context(&backend, params)?;
    let mut batch = LlamaBatch::new(n_batch as usize, 1);
    for (start, chunk) in prefix.chunks(n_batch as usize).enumerate() {
        batch.clear();
        for (j, &t) in chunk.iter().enumerate() {
            let pos = (start * n_batch as usize + j) as i32;
            batch.add(LlamaToken(t), pos, &[0], pos as usize + 1 == prefix.len())?;
        }
        ctx.decode(&mut batch)?;
    }
    let mut samples = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let started = Instant::now();
        ctx.copy_kv_cache_seq(0, 1, None, None)?;
        samples.push(started.elapsed().as_secs_f64());
        ctx.clear_kv_cache_seq(Some(1), None, None)?;
    }
    samples.sort_by(f64::total_cmp);
    println!(
        "{}",
        serde_json::json!({"prefix": prefix.len(), "median_us": samples[repeats / 2] * 1e6})
    );
    Ok(())
}
