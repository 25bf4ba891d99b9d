//! The baseline for fork latency in `bench/branching.py`: llama.cpp's own
//! KV sequence copy (`llama_memory_seq_cp`, unified KV) of a prefilled
//! prefix, timed with plain llama-cpp-2 calls. Prints the median of
//! `REPEATS` copies (each followed by clearing the copy, untimed).
//!
//! ```text
//! cargo run --example raw_seq_copy -- MODEL.gguf TOKENS.json N_CTX N_THREADS REPEATS
//! ```

use std::time::Instant;

use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;

mod common;
use common::{init_backend, prefill, raw_params, read_tokens, AnyResult};

fn main() -> AnyResult<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 6 {
        return Err("usage: raw_seq_copy MODEL TOKENS.json N_CTX N_THREADS REPEATS".into());
    }
    let prefix = read_tokens(&args[2])?;
    let n_ctx: u32 = args[3].parse()?;
    let n_threads: i32 = args[4].parse()?;
    let repeats: usize = args[5].parse()?;

    let backend = init_backend()?;
    let model = LlamaModel::load_from_file(&backend, &args[1], &LlamaModelParams::default())?;
    let n_batch = 512;
    let mut ctx = model.new_context(&backend, raw_params(n_ctx, n_batch, 2, n_threads))?;
    let mut batch = LlamaBatch::new(n_batch as usize, 1);
    prefill(&mut ctx, &mut batch, n_batch as usize, &prefix)?;
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
