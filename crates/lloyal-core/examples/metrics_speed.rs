//! Time entropy and surprisal over a Gemma-sized vocabulary.
use std::time::Instant;

use lloyal_core::metrics::{entropy, surprisal};
use lloyal_core::Base;

fn main() {
    let logits: Vec<f32> = (0..262_144)
        .map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 10.0)
        .collect();
    let n = 200;
    let t = Instant::now();
    let mut acc = 0.0;
    for i in 0..n {
        acc += surprisal(&logits, i, Base::Nats).unwrap();
    }
    println!(
        "surprisal {:.1} us",
        t.elapsed().as_secs_f64() / n as f64 * 1e6
    );
    let t = Instant::now();
    for _ in 0..n {
        acc += entropy(&logits, Base::Nats).unwrap();
    }
    println!(
        "entropy {:.1} us ({acc:.1})",
        t.elapsed().as_secs_f64() / n as f64 * 1e6
    );
}
