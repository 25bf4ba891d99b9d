//! The project's Q4_1 GEMM patch (patches/llama.cpp/0002-*) checked at the
//! op: one `GGML_OP_MUL_MAT` of Q4_1 weights by f32 activations, computed
//! by the patched path (llamafile's tinyBLAS, which now takes Q4_1 x Q8_1
//! from 2 activation columns on AVX2 hosts) and by ggml's reference path
//! (`use_ref`: the per-row dot products a batch of one token runs), with 1,
//! 2 and 3 threads. Every element must have the reference's exact bits:
//! that is what keeps a token's logits independent of its batch in the
//! deterministic mode (docs/determinism.md), and what tests/test_determinism.py
//! checks end to end on SmolLM2, whose weights are Q4_1.
//!
//! Shapes cover the kernel's edge tiles: weight rows and activation columns
//! that are not multiples of its 4 x 4 tile, one block (32 values) and many.
//! On a host without AVX2 both paths are the dot products, and equal.

use llama_cpp_sys_2 as sys;

mod common;
use common::Rng;

/// `W (rows x k, Q4_1) . X (k x cols, f32)`, row-major `cols x rows`.
fn mul_mat(rows: i64, cols: i64, k: i64, seed: u64, threads: i32, use_ref: bool) -> Vec<f32> {
    let mut rng = Rng(seed);
    unsafe {
        sys::ggml_cpu_init();
        let mem = (4 * (rows * k + k * cols + rows * cols) as usize) * 2 + (1 << 20);
        let ctx = sys::ggml_init(sys::ggml_init_params {
            mem_size: mem,
            mem_buffer: std::ptr::null_mut(),
            no_alloc: false,
        });
        assert!(!ctx.is_null());
        let w = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_Q4_1, k, rows);
        // Weights with an offset, as Q4_1's minimum is there for.
        let src: Vec<f32> = (0..rows * k)
            .map(|i| rng.unit() + (i % 7) as f32 * 0.1)
            .collect();
        sys::ggml_quantize_chunk(
            sys::GGML_TYPE_Q4_1,
            src.as_ptr(),
            (*w).data,
            0,
            rows,
            k,
            std::ptr::null(),
        );
        let x = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_F32, k, cols);
        let xd = std::slice::from_raw_parts_mut((*x).data as *mut f32, (k * cols) as usize);
        xd.iter_mut().for_each(|v| *v = rng.unit() * 3.0);
        let out = sys::ggml_mul_mat(ctx, w, x);
        common::compute_on_cpu(ctx, out, threads, use_ref);
        let result =
            std::slice::from_raw_parts(sys::ggml_get_data_f32(out), (rows * cols) as usize)
                .to_vec();
        sys::ggml_free(ctx);
        result
    }
}

#[test]
fn the_q4_1_gemm_has_the_dot_products_bits() {
    let mut checked = 0;
    for &(rows, k) in &[
        (1, 32),
        (3, 64),
        (4, 32),
        (5, 96),
        (7, 576),
        (64, 576),
        (67, 192),
    ] {
        for &cols in &[2, 3, 4, 5, 8, 13, 64] {
            let seed = (rows * 1000 + cols * 10 + k) as u64;
            let reference = mul_mat(rows, cols, k, seed, 1, true);
            assert!(reference.iter().all(|v| v.is_finite()));
            assert!(reference.iter().any(|&v| v != 0.0));
            for threads in 1..=3 {
                let got = mul_mat(rows, cols, k, seed, threads, false);
                let bad = got
                    .iter()
                    .zip(&reference)
                    .position(|(a, b)| a.to_bits() != b.to_bits());
                if let Some(i) = bad {
                    panic!(
                        "rows {rows} cols {cols} k {k} threads {threads}: element {i} is {} \
                         where the dot products give {}",
                        got[i], reference[i]
                    );
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 7 * 7 * 3);
}
