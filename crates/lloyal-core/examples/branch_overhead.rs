//! Per-step cost of branch commits without Python: wall time of a lockstep
//! produce + commit loop minus the time spent inside llama_decode.
//!
//! ```text
//! cargo run --example branch_overhead -- MODEL.gguf [N]
//! ```

use std::time::Instant;

use lloyal_core::{Context, ContextParams, SamplingParams};

fn wait<T: Send + 'static>(start: impl FnOnce(lloyal_core::Reply<T>)) -> lloyal_core::Result<T> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    start(Box::new(move |r| {
        let _ = tx.send(r);
    }));
    rx.recv().expect("worker replies")
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: branch_overhead MODEL.gguf [N]")?;
    let n: usize = args.next().map_or(Ok(1), |s| s.parse())?;
    let ctx = Context::open_blocking(
        path,
        ContextParams {
            n_ctx: 2048,
            n_seq_max: n as u32 + 1,
            n_threads: Some(2),
            ..ContextParams::default()
        },
    )?;
    let text = "The history of the printing press begins ".repeat(20);
    let prompt: Vec<i32> = ctx.model().tokenize(&text, None, false)?[..128].to_vec();
    let greedy = SamplingParams::greedy();
    let root = ctx.branch_create(greedy)?;
    wait(|r| ctx.branch_prefill(vec![(root, prompt)], r))?;
    let mut kids = Vec::new();
    for _ in 0..n {
        kids.push(wait(|r| ctx.branch_fork(root, r))?);
    }
    let before = ctx.stats();
    let steps = 64;
    let started = Instant::now();
    for _ in 0..steps {
        let gap = lloyal_core::context::now_ns()
            - lloyal_core::context::MARKS[9].load(std::sync::atomic::Ordering::SeqCst);
        lloyal_core::context::mark(0);
        let tp = Instant::now();
        let items = kids
            .iter()
            .map(|&k| Ok((k, ctx.branch_produce(k)?)))
            .collect::<lloyal_core::Result<Vec<_>>>()?;
        let tw = Instant::now();
        wait(|r| ctx.branch_commit(items, r))?;
        lloyal_core::context::mark(8);
        let m: Vec<u64> = lloyal_core::context::MARKS
            .iter()
            .map(|a| a.load(std::sync::atomic::Ordering::SeqCst))
            .collect();
        eprintln!("gap {} pre-submit {} produce {:?} submit->recv {} recv->commit {} commit->decode {} decode {} decode->end {} clear {} reply {}", gap/1000, (m[1]-m[0])/1000, tw - tp, (m[2]-m[1])/1000, (m[3]-m[2])/1000, (m[4]-m[3])/1000, (m[5]-m[4])/1000, (m[6]-m[5])/1000, (m[7]-m[6])/1000, (m[8]-m[7])/1000);
        lloyal_core::context::mark(9);
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
