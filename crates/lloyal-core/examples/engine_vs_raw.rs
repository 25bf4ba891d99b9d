//! The engine without Python next to the raw llama-cpp-2 loop, in one
//! process: N branches forked from a 128-token prompt (engine) and N
//! sequences copied from it (raw) take turns decoding greedy lockstep
//! chunks of 16 steps (who goes first alternates), and each chunk pair
//! prints both speeds and their ratio. On the 2-core development machine
//! the ratio stays around 1.0 at N=1 and N=8, so what `bench/branching.py`
//! finds between Python and raw is the Python layer's.
//!
//! ```text
//! cargo run --example engine_vs_raw -- MODEL.gguf N
//! ```

use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use lloyal_core::{Context, ContextParams, SamplingParams};

fn argmax(logits: &[f32]) -> i32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as i32
}
fn wait<T: Send + 'static>(start: impl FnOnce(lloyal_core::Reply<T>)) -> lloyal_core::Result<T> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    start(Box::new(move |r| {
        let _ = tx.send(r);
    }));
    rx.recv().expect("reply")
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: engine_vs_raw MODEL.gguf N")?;
    let n: usize = args
        .next()
        .ok_or("usage: engine_vs_raw MODEL.gguf N")?
        .parse()?;
    let chunk = 16;
    let chunks = 8;
    let n_ctx = 4096u32;
    let eng = Context::open_blocking(
        &path,
        ContextParams {
            n_ctx,
            n_seq_max: n as u32 + 1,
            n_threads: Some(2),
            ..ContextParams::default()
        },
    )?;
    let text = "The history of the printing press begins ".repeat(20);
    let prompt: Vec<i32> = eng.model().tokenize(&text, None, false)?[..128].to_vec();
    let root = eng.branch_create(SamplingParams::greedy())?;
    wait(|r| eng.branch_prefill(vec![(root, prompt.clone())], r))?;
    let mut kids = Vec::new();
    for _ in 0..n {
        kids.push(wait(|r| eng.branch_fork(root, r))?);
    }

    let backend = lloyal_core::backend()?;
    let model = LlamaModel::load_from_file(backend, &path, &LlamaModelParams::default())?;
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(n_ctx))
        .with_n_batch(512)
        .with_n_ubatch(512)
        .with_n_seq_max(n as u32)
        .with_n_threads(2)
        .with_n_threads_batch(2)
        .with_kv_unified(true)
        .with_swa_full(true);
    let mut ctx = model.new_context(backend, params)?;
    let mut batch = LlamaBatch::new(512, 1);
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
    for c in 0..chunks {
        let mut raw_run = || -> Result<f64, Box<dyn std::error::Error>> {
            let t = Instant::now();
            for _ in 0..chunk {
                batch.clear();
                for (seq, &tok) in next.iter().enumerate() {
                    batch.add(LlamaToken(tok), pos, &[seq as i32], true)?;
                }
                ctx.decode(&mut batch)?;
                for (row, tok) in next.iter_mut().enumerate() {
                    *tok = argmax(ctx.get_logits_ith(row as i32));
                }
                pos += 1;
            }
            Ok(t.elapsed().as_secs_f64())
        };
        let eng_run = || -> Result<(f64, f64), Box<dyn std::error::Error>> {
            let d0 = eng.stats().decode_seconds;
            let t = Instant::now();
            for _ in 0..chunk {
                let items = kids
                    .iter()
                    .map(|&k| Ok((k, eng.branch_produce(k)?)))
                    .collect::<lloyal_core::Result<Vec<_>>>()?;
                wait(|r| eng.branch_commit(items, r))?;
            }
            Ok((t.elapsed().as_secs_f64(), eng.stats().decode_seconds - d0))
        };
        let (r, (e, d));
        std::thread::sleep(Duration::from_millis(20));
        if c % 2 == 0 {
            r = raw_run()?;
            std::thread::sleep(Duration::from_millis(20));
            (e, d) = eng_run()?;
        } else {
            (e, d) = eng_run()?;
            std::thread::sleep(Duration::from_millis(20));
            r = raw_run()?;
        }
        let k = chunk as f64 / 1e3;
        println!(
            "raw {:.2} ms/step  engine {:.2}  engine-decode {:.2}  ratio {:.3}",
            r / k,
            e / k,
            d / k,
            r / e
        );
    }
    eng.close_blocking();
    Ok(())
}
