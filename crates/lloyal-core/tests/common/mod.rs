//! What the model-backed integration tests share.
#![allow(dead_code)] // each test file uses part of it

pub fn model_path() -> String {
    std::env::var("LLOYAL_TEST_MODEL")
        .expect("set LLOYAL_TEST_MODEL to a GGUF file (make test-rust does this)")
}

/// xorshift64*: enough randomness for weights, no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn normal(&mut self, sd: f32) -> f32 {
        let mut u = || {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f32 / (1u64 << 53) as f32
        };
        let (a, b) = (u().max(1e-7), u());
        sd * (-2.0 * a.ln()).sqrt() * (std::f32::consts::TAU * b).cos()
    }
}
