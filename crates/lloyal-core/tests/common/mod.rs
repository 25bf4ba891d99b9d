//! What the model-backed integration tests share.
#![allow(dead_code)] // each test file uses part of it

pub fn model_path() -> String {
    std::env::var("LLOYAL_TEST_MODEL")
        .expect("set LLOYAL_TEST_MODEL to a GGUF file (make test-rust does this)")
}

/// xorshift64*: enough randomness for weights, no dependency, and a
/// failure reproduces from its seed.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn normal(&mut self, sd: f32) -> f32 {
        let mut u = || (self.next() >> 11) as f32 / (1u64 << 53) as f32;
        let (a, b) = (u().max(1e-7), u());
        sd * (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
    }
}
