//! Per-token cost of the engine's worker round trip, without Python:
//! wall time of `decode_blocking` minus the time spent inside llama_decode.
//!
//! ```text
//! cargo run --example engine_overhead -- MODEL.gguf
//! ```

use std::time::Instant;

use lloyal_core::{sampling, Context, ContextParams};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: engine_overhead MODEL.gguf")?;
    let ctx = Context::open_blocking(
        path,
        ContextParams {
            n_ctx: 1024,
            ..ContextParams::default()
        },
    )?;
    let text = "hello world ".repeat(300);
    let prompt: Vec<i32> = ctx.model().tokenize(&text, None, false)?[..512].to_vec();
    ctx.decode_blocking(prompt.clone(), 0, 0)?;
    let before = ctx.stats();
    let n = 64;
    let started = Instant::now();
    for i in 0..n {
        let t = sampling::greedy(&ctx.logits()?).ok_or("no token")?;
        ctx.decode_blocking(vec![t], (prompt.len() + i) as i32, 0)?;
    }
    let wall = started.elapsed().as_secs_f64();
    let inside = ctx.stats().decode_seconds - before.decode_seconds;
    println!(
        "wall/token {:.2} ms, inside llama_decode {:.2} ms, overhead {:.3} ms",
        wall / n as f64 * 1e3,
        inside / n as f64 * 1e3,
        (wall - inside) / n as f64 * 1e3
    );
    ctx.close_blocking();
    Ok(())
}
