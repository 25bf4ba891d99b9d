use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use std::time::Instant;
mod common;
use common::{argmax, init_backend, prefill, raw_params, read_tokens, AnyResult};
fn main() -> AnyResult<()> {
    let args: Vec<String> = std::env::args().collect();
    let prompt = read_tokens(&args[2])?;
    let n: usize = args[3].parse()?;
    let steps: usize = args[4].parse()?;
    let backend = init_backend()?;
    let model = LlamaModel::load_from_file(&backend, &args[1], &LlamaModelParams::default())?;
    let params = raw_params(1024, 512, u32::try_from(n + 1)?, 2);
    let mut ctx = model.new_context(&backend, params)?;
    let mut batch = LlamaBatch::new(512, 1);
    let first = prefill(&mut ctx, &mut batch, 512, &prompt)?;
    for seq in 1..n as i32 {
        ctx.copy_kv_cache_seq(0, seq, None, None)?;
    }
    let mut next = vec![first; n];
    let mut pos = prompt.len() as i32;
    for _ in 0..4 {
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
    std::thread::sleep(std::time::Duration::from_millis(50));
    let mut dec = 0.0;
    let started = Instant::now();
    for _ in 0..steps {
        batch.clear();
        for (seq, &t) in next.iter().enumerate() {
            batch.add(LlamaToken(t), pos, &[seq as i32], true)?;
        }
        let d = Instant::now();
        ctx.decode(&mut batch)?;
        dec += d.elapsed().as_secs_f64();
        for (row, t) in next.iter_mut().enumerate() {
            *t = argmax(ctx.get_logits_ith(row as i32));
        }
        pos += 1;
    }
    let wall = started.elapsed().as_secs_f64();
    println!(
        "{{\"wall_ms_step\": {}, \"decode_ms_step\": {}}}",
        1e3 * wall / steps as f64,
        1e3 * dec / steps as f64
    );
    Ok(())
}
