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

/// Computes the graph of `out` on the CPU with `threads` threads, by ggml's
/// reference paths (`use_ref`) or its fast ones, as llama.cpp's
/// test-backend-ops compares them.
///
/// # Safety
/// `ctx` and `out` come from one live ggml context with its data allocated.
pub unsafe fn compute_on_cpu(
    ctx: *mut llama_cpp_sys_2::ggml_context,
    out: *mut llama_cpp_sys_2::ggml_tensor,
    threads: i32,
    use_ref: bool,
) {
    use llama_cpp_sys_2 as sys;
    let gf = sys::ggml_new_graph(ctx);
    sys::ggml_build_forward_expand(gf, out);
    let mut plan = sys::ggml_graph_plan(gf, threads, std::ptr::null_mut());
    let mut work = vec![0u8; plan.work_size];
    plan.work_data = work.as_mut_ptr();
    plan.use_ref = use_ref;
    assert_eq!(
        sys::ggml_graph_compute(gf, &mut plan),
        sys::GGML_STATUS_SUCCESS
    );
}
