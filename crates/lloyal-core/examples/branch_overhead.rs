//! Per-step cost of branch commits without Python: wall time of a lockstep
//! produce + commit loop minus the time spent inside llama_decode (the
//! worker hand-offs, accept-time perplexity, logits copies). Compare with
//! `raw_batched` for the same N.
//!
//! ```text
//! cargo run --example branch_overhead -- MODEL.gguf [N]
//! ```

use std::time::Instant;

mod common;
use common::{engine_forks, engine_step, AnyResult};

fn main() -> AnyResult<()> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: branch_overhead MODEL.gguf [N]")?;
    let n: usize = args.next().map_or(Ok(1), |s| s.parse())?;
    let (ctx, _, kids) = engine_forks(&path, n, 2048)?;
    let before = ctx.stats();
    let steps = 64;
    let started = Instant::now();
    for _ in 0..steps {
        engine_step(&ctx, &kids)?;
    }
    let wall = started.elapsed().as_secs_f64();
    let inside = ctx.stats().decode_seconds - before.decode_seconds;
    println!(
        "N={n} wall/step {:.2} ms, inside llama_decode {:.2} ms, overhead {:.0} us",
        wall / steps as f64 * 1e3,
        inside / steps as f64 * 1e3,
        (wall - inside) / steps as f64 * 1e6
    );
    ctx.close_blocking();
    Ok(())
}
