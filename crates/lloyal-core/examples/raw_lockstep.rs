//! A plain llama-cpp-2 ceiling for batched generation over *distinct*
//! prompts: what llama.cpp alone does with a workload, with no lloyal code
//! in the loop. `bench/program.py` and `bench/kv_streams.py` print it
//! beside what lloyal does.
//!
//! The prompts run in groups of `LANES`: a group's prompts are prefilled
//! together (one sequence each, in as few decodes as `n_batch` allows), then
//! `STEPS` lockstep steps decode one greedy token per sequence, all in one
//! `llama_decode`. The cache is cleared between groups. `LANES` = 1 runs
//! the prompts one after another; `LANES` = the number of prompts runs them
//! all at once.
//!
//! `KV` is `unified` (lloyal's layout: one cell pool that every sequence
//! shares, so each token's attention scans every used cell), `unified63`
//! (the same, each step's tokens decoded in decodes of at most 63, as
//! lloyal's worker decodes many commits when attention dominates: docs/
//! batching.md, "Many sequences") or `split` (one stream of cells per
//! sequence, as llama-server runs its slots).
//!
//! ```text
//! cargo run --example raw_lockstep -- MODEL PROMPTS.json STEPS N_THREADS LANES KV
//! ```
//!
//! `PROMPTS.json` is a JSON array of token-id arrays. The answer is one JSON
//! line: wall seconds in all, in prefill and in the steps, and the number
//! of decodes.

use std::time::Instant;

use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

mod common;
use common::{argmax, init_backend, raw_params, AnyResult};

fn main() -> AnyResult<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 7 {
        return Err(
            "usage: raw_lockstep MODEL PROMPTS.json STEPS N_THREADS LANES unified|unified63|split"
                .into(),
        );
    }
    let prompts: Vec<Vec<i32>> = serde_json::from_str(&std::fs::read_to_string(&args[2])?)?;
    let steps: usize = args[3].parse()?;
    let n_threads: i32 = args[4].parse()?;
    let lanes: usize = args[5].parse()?;
    let (unified, most_rows) = match args[6].as_str() {
        "unified" => (true, usize::MAX),
        "unified63" => (true, 63),
        "split" => (false, usize::MAX),
        other => return Err(format!("KV is unified, unified63 or split, not {other:?}").into()),
    };
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) || lanes == 0 {
        return Err("need at least one lane and one non-empty prompt".into());
    }

    let backend = init_backend()?;
    let model = LlamaModel::load_from_file(&backend, &args[1], &LlamaModelParams::default())?;
    let n_batch: usize = 512;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    // Each sequence gets the same number of cells in either layout (split
    // KV gives every stream n_ctx / n_seq_max of them).
    let per_seq = (longest + steps + 1).div_ceil(256) * 256;
    let n_ctx = u32::try_from(per_seq * lanes)?;
    let params = raw_params(n_ctx, n_batch as u32, u32::try_from(lanes)?, n_threads)
        .with_kv_unified(unified);
    let mut ctx = model.new_context(&backend, params)?;
    let mut batch = LlamaBatch::new(n_batch, 1);

    let (mut prefill_s, mut step_s, mut decodes) = (0.0, 0.0, 0usize);
    let started = Instant::now();
    for group in prompts.chunks(lanes) {
        ctx.clear_kv_cache();
        let t = Instant::now();
        let mut next = vec![0; group.len()];
        // The group's prompt tokens, sequence by sequence, in n_batch chunks;
        // each sequence's last token asks for logits.
        let tokens: Vec<(i32, i32, usize, bool)> = group
            .iter()
            .enumerate()
            .flat_map(|(seq, p)| {
                p.iter()
                    .enumerate()
                    .map(move |(i, &t)| (t, i as i32, seq, i + 1 == p.len()))
            })
            .collect();
        for chunk in tokens.chunks(n_batch) {
            batch.clear();
            for &(t, pos, seq, logits) in chunk {
                batch.add(LlamaToken(t), pos, &[seq as i32], logits)?;
            }
            ctx.decode(&mut batch)?;
            decodes += 1;
            for (row, &(_, _, seq, logits)) in chunk.iter().enumerate() {
                if logits {
                    next[seq] = argmax(ctx.get_logits_ith(row as i32));
                }
            }
        }
        prefill_s += t.elapsed().as_secs_f64();
        // Each sequence continues from its own prompt's length.
        let t = Instant::now();
        let lens: Vec<i32> = group.iter().map(|p| p.len() as i32).collect();
        for k in 0..steps as i32 {
            decodes += step_at(&mut ctx, &mut batch, &mut next, &lens, k, most_rows)?;
        }
        step_s += t.elapsed().as_secs_f64();
    }
    println!(
        "{}",
        serde_json::json!({
            "lanes": lanes,
            "kv": args[6],
            "prompts": prompts.len(),
            "steps": steps,
            "seconds": started.elapsed().as_secs_f64(),
            "prefill_seconds": prefill_s,
            "step_seconds": step_s,
            "decodes": decodes,
        })
    );
    Ok(())
}

/// One lockstep step: sequence `s` decodes `next[s]` at position
/// `lens[s] + k`, in decodes of at most `most_rows` tokens (one, when it is
/// at least the number of sequences); then each row's greedy token. The
/// number of decodes.
fn step_at(
    ctx: &mut llama_cpp_2::context::LlamaContext<'_>,
    batch: &mut LlamaBatch<'_>,
    next: &mut [i32],
    lens: &[i32],
    k: i32,
    most_rows: usize,
) -> AnyResult<usize> {
    let mut decodes = 0;
    for (c, chunk) in next.chunks_mut(most_rows).enumerate() {
        let first = c * most_rows;
        batch.clear();
        for (row, &t) in chunk.iter().enumerate() {
            let seq = first + row;
            batch.add(LlamaToken(t), lens[seq] + k, &[seq as i32], true)?;
        }
        ctx.decode(batch)?;
        decodes += 1;
        for (row, t) in chunk.iter_mut().enumerate() {
            *t = argmax(ctx.get_logits_ith(row as i32));
        }
    }
    Ok(decodes)
}
