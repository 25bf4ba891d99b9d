//! The project's flash attention patch (patches/llama.cpp/0001-*) checked at
//! the op, as llama.cpp's test-backend-ops checks a CPU kernel: one
//! `GGML_OP_FLASH_ATTN_EXT` on random data, computed by the patched kernels
//! and by ggml's reference path (`use_ref`: the per-row kernel scanning
//! every cell, no tiling, no KV split), with 1, 2 and 3 threads.
//!
//! - Where the patch runs the per-row kernel (a quantized KV cache, 2 to 63
//!   query rows, and 64 or more rows of many sequences' single tokens), the
//!   output has the reference's exact bits: walking the visible cells
//!   skips only what the reference skips.
//! - Where it runs the tiled kernel or splits the cells of one row among
//!   threads (F16 KV), the output is within test-backend-ops' tolerance for
//!   this op (normalized mean squared error 5e-4).
//!
//! Masks as llama.cpp builds them for a unified KV cache: sequences
//! interleaved by lockstep decoding, a causal prompt after a prefix, forks of
//! two prompts, random visibility, rows that see nothing, ALiBi's finite
//! values, per-head masks; head sizes of SmolLM2 (64), 128 and Gemma 3 (256)
//! with grouped KV heads, logit softcap and attention sinks.

use llama_cpp_sys_2 as sys;

mod common;
use common::Rng;

const NINF: u16 = 0xFC00; // -inf in f16
const ZERO: u16 = 0;

#[derive(Clone, Copy, PartialEq)]
enum Kv {
    F16,
    Q8,
}

#[derive(Clone, Copy)]
enum Outcome {
    /// The reference's exact bits.
    SameBits,
    /// Within test-backend-ops' tolerance.
    Close,
}

struct Case {
    name: &'static str,
    dk: i64,
    heads: i64,
    kv_heads: i64,
    n_q: i64,
    n_kv: i64,
    kv: Kv,
    /// mask[head][row][cell]: f16 bits; one head unless per-head
    mask: Vec<Vec<Vec<u16>>>,
    softcap: f32,
    max_bias: f32,
    sinks: bool,
    outcome: Outcome,
}

/// `seqs` sequences each with a prompt of `prompt` cells (contiguous, one
/// sequence after another), then `steps` lockstep rounds that append one
/// cell per sequence: cells of a sequence are scattered. Row s is the token
/// of sequence s in the last round.
fn interleaved(seqs: usize, prompt: usize, steps: usize, pad: usize) -> Vec<Vec<u16>> {
    let n_kv = seqs * (prompt + steps) + pad;
    (0..seqs)
        .map(|s| {
            let mut row = vec![NINF; n_kv];
            row[s * prompt..(s + 1) * prompt].fill(ZERO);
            for j in 0..steps {
                row[seqs * prompt + j * seqs + s] = ZERO;
            }
            row
        })
        .collect()
}

/// One sequence: `prefix` cells, then `n` prompt tokens each seeing the
/// prefix and the tokens before it (and `pad` unused cells after).
fn causal(prefix: usize, n: usize, pad: usize) -> Vec<Vec<u16>> {
    let n_kv = prefix + n + pad;
    (0..n)
        .map(|i| {
            let mut row = vec![NINF; n_kv];
            row[..=prefix + i].fill(ZERO);
            row
        })
        .collect()
}

/// Two prompts of `p` cells, `n / 2` forks of each decoding one token: a
/// fork sees its prompt and its own new cell.
fn two_prompts(p: usize, n: usize) -> Vec<Vec<u16>> {
    let n_kv = 2 * p + n;
    (0..n)
        .map(|i| {
            let mut row = vec![NINF; n_kv];
            let group = i * 2 / n;
            row[group * p..(group + 1) * p].fill(ZERO);
            row[2 * p + i] = ZERO;
            row
        })
        .collect()
}

/// A turn of many conversations under one shared prefix: `prefix` cells
/// every row sees, then `steps` lockstep rounds of `seqs` sequences (each
/// sequence's cells scattered), then a prompt of `n` tokens per sequence,
/// one sequence after another; a row sees the prefix, its sequence's
/// scattered cells and its prompt's tokens up to itself. The tiled kernel
/// computes it from KV tiles gathered from what the rows see.
fn turn(prefix: usize, seqs: usize, steps: usize, n: usize) -> Vec<Vec<u16>> {
    let n_kv = prefix + seqs * (steps + n);
    let own = prefix + seqs * steps;
    (0..seqs * n)
        .map(|r| {
            let (s, i) = (r / n, r % n);
            let mut row = vec![NINF; n_kv];
            row[..prefix].fill(ZERO);
            for j in 0..steps {
                row[prefix + j * seqs + s] = ZERO;
            }
            row[own + s * n..=own + s * n + i].fill(ZERO);
            row
        })
        .collect()
}

fn random(rng: &mut Rng, n: usize, n_kv: usize, density_pct: usize) -> Vec<Vec<u16>> {
    (0..n)
        .map(|_| {
            (0..n_kv)
                .map(|_| {
                    if rng.below(100) < density_pct {
                        ZERO
                    } else {
                        NINF
                    }
                })
                .collect()
        })
        .collect()
}

/// ALiBi-style finite values (a negative distance) where `base` is visible.
fn with_distances(base: Vec<Vec<u16>>) -> Vec<Vec<u16>> {
    base.into_iter()
        .enumerate()
        .map(|(i, row)| {
            let n = row.len();
            row.into_iter()
                .enumerate()
                .map(|(c, m)| {
                    if m == NINF {
                        m
                    } else {
                        let d = -((c as f32 - (n - 1 - i % n) as f32).abs()) / 16.0;
                        let mut h = 0u16;
                        unsafe { sys::ggml_fp32_to_fp16_row(&d, &mut h, 1) };
                        h
                    }
                })
                .collect()
        })
        .collect()
}

impl Case {
    /// `shape`: head size (K and V), query heads, KV heads.
    fn new(
        name: &'static str,
        shape: (i64, i64, i64),
        kv: Kv,
        mask: Vec<Vec<u16>>,
        outcome: Outcome,
    ) -> Self {
        let (dk, heads, kv_heads) = shape;
        Case {
            name,
            dk,
            heads,
            kv_heads,
            n_q: mask.len() as i64,
            n_kv: mask[0].len() as i64,
            kv,
            mask: vec![mask],
            softcap: 0.0,
            max_bias: 0.0,
            sinks: false,
            outcome,
        }
    }
    fn softcap(mut self, cap: f32) -> Self {
        self.softcap = cap;
        self
    }
    fn alibi(mut self, max_bias: f32) -> Self {
        self.max_bias = max_bias;
        self
    }
    fn sinks(mut self) -> Self {
        self.sinks = true;
        self
    }
    /// One mask per query head (mask->ne[2] == heads).
    fn per_head(mut self, masks: Vec<Vec<Vec<u16>>>) -> Self {
        self.mask = masks;
        self
    }
}

fn cases() -> Vec<Case> {
    use Kv::{F16, Q8};
    use Outcome::{Close, SameBits};
    const SMOL: (i64, i64, i64) = (64, 9, 3); // SmolLM2's attention
    const GEMMA: (i64, i64, i64) = (256, 4, 1); // Gemma 3 270M's
    const MID: (i64, i64, i64) = (128, 8, 2);
    const SMALL: (i64, i64, i64) = (64, 4, 2);
    let mut rng = Rng(0x5EED_F1A5_0000_0001);
    let mut heads_of = |n: usize, n_kv: usize, pct: usize| -> Vec<Vec<Vec<u16>>> {
        (0..4).map(|_| random(&mut rng, n, n_kv, pct)).collect()
    };
    let per_head_sparse = heads_of(64, 64 * 30, 3);
    let per_head_dense = heads_of(12, 52, 40);
    let mut rng = Rng(0x5EED_F1A5_0000_0002);
    vec![
        // many sequences' single tokens: 64 and 100 rows leave the tiled
        // kernel for the per-row one (upstream tiles them: another kernel)
        Case::new(
            "64 sequences, f16",
            SMOL,
            F16,
            interleaved(64, 20, 30, 128),
            SameBits,
        ),
        Case::new(
            "100 sequences, f16",
            (64, 4, 1),
            F16,
            interleaved(100, 9, 12, 0),
            SameBits,
        ),
        Case::new(
            "64 sequences, head 256",
            GEMMA,
            F16,
            interleaved(64, 30, 20, 64),
            SameBits,
        ),
        Case::new(
            "8 sequences",
            SMOL,
            F16,
            interleaved(8, 40, 50, 256),
            SameBits,
        ),
        Case::new(
            "64 sequences, q8_0",
            MID,
            Q8,
            interleaved(64, 16, 24, 0),
            SameBits,
        ),
        // one sequence: its prompt on the tiled kernel, one token's decode
        // split among threads (F16), or the per-row kernel
        Case::new(
            "prompt after a prefix",
            SMOL,
            F16,
            causal(300, 130, 100),
            Close,
        ),
        Case::new("prompt from the start", MID, F16, causal(0, 200, 56), Close),
        Case::new("short prompt", SMOL, F16, causal(70, 40, 30), SameBits),
        Case::new("prompt, q8_0", SMOL, Q8, causal(100, 90, 0), SameBits),
        Case::new(
            "one token over 1000 cells",
            SMOL,
            F16,
            causal(999, 1, 25),
            Close,
        ),
        Case::new("one token, q8_0", SMOL, Q8, causal(700, 1, 0), SameBits),
        Case::new(
            "one token of many",
            SMOL,
            F16,
            interleaved(40, 20, 10, 0)[..1].to_vec(),
            Close,
        ),
        // forks of two prompts: dense rows, each prompt's tiles for its forks
        Case::new("two prompts' forks", SMOL, F16, two_prompts(200, 64), Close),
        Case::new(
            "two prompts' forks, 70",
            GEMMA,
            F16,
            two_prompts(130, 70),
            Close,
        ),
        // a turn of 32 conversations sharing a prefix: tiled, their earlier
        // tokens gathered into full KV tiles
        Case::new(
            "a turn under a shared prefix",
            SMOL,
            F16,
            turn(600, 32, 24, 25),
            Close,
        ),
        Case::new("a turn, head 256", GEMMA, F16, turn(500, 32, 32, 10), Close),
        // random visibility, and rows that see nothing
        Case::new(
            "random 30%",
            SMALL,
            F16,
            random(&mut rng, 80, 700, 30),
            Close,
        ),
        Case::new(
            "random 2%",
            SMALL,
            F16,
            random(&mut rng, 96, 1500, 2),
            Close,
        ),
        Case::new(
            "random 5%, 20 rows",
            SMALL,
            F16,
            random(&mut rng, 20, 600, 5),
            SameBits,
        ),
        Case::new(
            "random 0%",
            SMALL,
            F16,
            random(&mut rng, 70, 300, 0),
            SameBits,
        ),
        // Gemma 2's logit softcap and gpt-oss's sinks, on both kernels
        Case::new(
            "softcap, sparse",
            SMALL,
            F16,
            interleaved(64, 10, 20, 0),
            SameBits,
        )
        .softcap(30.0),
        Case::new("softcap, prompt", SMALL, F16, causal(64, 64, 0), Close).softcap(30.0),
        Case::new(
            "sinks, sparse",
            SMALL,
            F16,
            interleaved(64, 10, 20, 0),
            SameBits,
        )
        .sinks(),
        Case::new("sinks, prompt", SMALL, F16, causal(10, 100, 0), Close).sinks(),
        // ALiBi: finite mask values, scaled by a slope per head
        Case::new(
            "alibi, sparse",
            (64, 8, 8),
            F16,
            with_distances(interleaved(64, 12, 16, 0)),
            SameBits,
        )
        .alibi(8.0),
        Case::new(
            "alibi, q8_0",
            (64, 8, 8),
            Q8,
            with_distances(causal(50, 30, 0)),
            SameBits,
        )
        .alibi(8.0),
        // a mask per head: each head its own visibility
        Case::new(
            "per-head masks",
            SMALL,
            F16,
            interleaved(64, 10, 20, 0),
            SameBits,
        )
        .per_head(per_head_sparse),
        Case::new(
            "per-head masks, 12 rows",
            SMALL,
            Q8,
            causal(40, 12, 0),
            SameBits,
        )
        .per_head(per_head_dense),
    ]
}

/// The op's output computed by the patched kernels (`use_ref` false) or the
/// reference path, with `threads` threads.
fn compute(case: &Case, rng_seed: u64, threads: i32, use_ref: bool) -> Vec<f32> {
    let mut rng = Rng(rng_seed);
    unsafe {
        sys::ggml_cpu_init();
        let q_len = case.dk * case.n_q * case.heads;
        let kv_len = case.dk * case.n_kv * case.kv_heads;
        let mask_len = case.n_kv * case.n_q * case.mask.len() as i64;
        let mem = (4 * q_len + 4 * 4 * kv_len + 2 * mask_len + 4 * case.dk * case.n_q * case.heads)
            as usize
            + (1 << 20);
        let ctx = sys::ggml_init(sys::ggml_init_params {
            mem_size: mem,
            mem_buffer: std::ptr::null_mut(),
            no_alloc: false,
        });
        assert!(!ctx.is_null());
        let kv_type = match case.kv {
            Kv::F16 => sys::GGML_TYPE_F16,
            Kv::Q8 => sys::GGML_TYPE_Q8_0,
        };
        let q = sys::ggml_new_tensor_4d(ctx, sys::GGML_TYPE_F32, case.dk, case.n_q, case.heads, 1);
        let qd = std::slice::from_raw_parts_mut((*q).data as *mut f32, q_len as usize);
        qd.iter_mut().for_each(|x| *x = rng.unit());
        let mut kv = || {
            let t = sys::ggml_new_tensor_4d(ctx, kv_type, case.dk, case.n_kv, case.kv_heads, 1);
            let src: Vec<f32> = (0..kv_len).map(|_| rng.unit()).collect();
            match case.kv {
                Kv::F16 => sys::ggml_fp32_to_fp16_row(src.as_ptr(), (*t).data as *mut u16, kv_len),
                Kv::Q8 => {
                    sys::ggml_quantize_chunk(
                        kv_type,
                        src.as_ptr(),
                        (*t).data,
                        0,
                        case.n_kv * case.kv_heads,
                        case.dk,
                        std::ptr::null(),
                    );
                }
            }
            t
        };
        let k = kv();
        let v = kv();
        let heads_in_mask = case.mask.len() as i64;
        let mask = sys::ggml_new_tensor_4d(
            ctx,
            sys::GGML_TYPE_F16,
            case.n_kv,
            case.n_q,
            heads_in_mask,
            1,
        );
        let md = std::slice::from_raw_parts_mut((*mask).data as *mut u16, mask_len as usize);
        for (h, rows) in case.mask.iter().enumerate() {
            for (r, row) in rows.iter().enumerate() {
                let at = (h * case.n_q as usize + r) * case.n_kv as usize;
                md[at..at + row.len()].copy_from_slice(row);
            }
        }
        let out = sys::ggml_flash_attn_ext(
            ctx,
            q,
            k,
            v,
            mask,
            1.0 / (case.dk as f32).sqrt(),
            case.max_bias,
            case.softcap,
        );
        if case.sinks {
            let s = sys::ggml_new_tensor_1d(ctx, sys::GGML_TYPE_F32, case.heads);
            let sd = std::slice::from_raw_parts_mut((*s).data as *mut f32, case.heads as usize);
            sd.iter_mut().for_each(|x| *x = rng.unit() * 2.0);
            sys::ggml_flash_attn_ext_add_sinks(out, s);
        }
        common::compute_on_cpu(ctx, out, threads, use_ref);
        let n = (case.dk * case.heads * case.n_q) as usize;
        let result = std::slice::from_raw_parts(sys::ggml_get_data_f32(out), n).to_vec();
        sys::ggml_free(ctx);
        result
    }
}

/// Normalized mean squared error, as test-backend-ops computes it.
fn nmse(a: &[f32], reference: &[f32]) -> f64 {
    let (mut err, mut norm) = (0.0f64, 0.0f64);
    for (&x, &r) in a.iter().zip(reference) {
        err += f64::from(x - r).powi(2);
        norm += f64::from(r).powi(2);
    }
    err / norm.max(f64::MIN_POSITIVE)
}

#[test]
fn the_patched_kernels_agree_with_the_reference() {
    let mut failures = Vec::new();
    for (i, case) in cases().iter().enumerate() {
        let seed = 0xA77E_0000 + i as u64;
        for threads in [1, 2, 3] {
            let reference = compute(case, seed, threads, true);
            let got = compute(case, seed, threads, false);
            assert!(
                got.iter().all(|x| x.is_finite()),
                "{}: not finite",
                case.name
            );
            let ok = match case.outcome {
                Outcome::SameBits => got
                    .iter()
                    .zip(&reference)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                Outcome::Close => nmse(&got, &reference) < 5e-4,
            };
            if !ok {
                failures.push(format!(
                    "{} ({} threads): nmse {:.3e}, {} of {} values differ",
                    case.name,
                    threads,
                    nmse(&got, &reference),
                    got.iter()
                        .zip(&reference)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count(),
                    got.len()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A row that sees no cell gets zeros, in both paths (and a decode of only
/// such rows skips every KV tile).
#[test]
fn rows_that_see_nothing_are_zero() {
    let case = Case::new(
        "nothing visible",
        (64, 4, 2),
        Kv::F16,
        vec![vec![NINF; 300]; 70],
        Outcome::SameBits,
    );
    for threads in [1, 2] {
        assert!(compute(&case, 7, threads, false).iter().all(|&x| x == 0.0));
    }
}
