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

use std::time::{Duration, Instant};

use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;

mod common;
use common::{engine_forks, engine_step, lockstep_step, prefill, raw_params, AnyResult};

fn main() -> AnyResult<()> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: engine_vs_raw MODEL.gguf N")?;
    let n: usize = args
        .next()
        .ok_or("usage: engine_vs_raw MODEL.gguf N")?
        .parse()?;
    let chunk = 16;
    let chunks = 8;
    let n_ctx = 4096u32;
    let (eng, prompt, kids) = engine_forks(&path, n, n_ctx)?;

    let backend = lloyal_core::backend()?;
    let model = LlamaModel::load_from_file(backend, &path, &LlamaModelParams::default())?;
    let mut ctx = model.new_context(backend, raw_params(n_ctx, 512, n as u32, 2))?;
    let mut batch = LlamaBatch::new(512, 1);
    let first = prefill(&mut ctx, &mut batch, 512, &prompt)?;
    for seq in 1..n as i32 {
        ctx.copy_kv_cache_seq(0, seq, None, None)?;
    }
    let mut next = vec![first; n];
    let mut pos = prompt.len() as i32;
    for c in 0..chunks {
        let mut raw_run = || -> AnyResult<f64> {
            let t = Instant::now();
            for _ in 0..chunk {
                lockstep_step(&mut ctx, &mut batch, &mut next, pos)?;
                pos += 1;
            }
            Ok(t.elapsed().as_secs_f64())
        };
        let eng_run = || -> AnyResult<(f64, f64)> {
            let d0 = eng.stats().decode_seconds;
            let t = Instant::now();
            for _ in 0..chunk {
                engine_step(&eng, &kids)?;
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
