//! Information measures over a logits vector, and the running perplexity
//! that branches carry.

use crate::error::{invalid, Result};
use std::sync::{Arc, OnceLock};

/// Units for entropy and surprisal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Base {
    #[default]
    Nats,
    Bits,
}

impl Base {
    fn scale(self, nats: f64) -> f64 {
        match self {
            Base::Nats => nats,
            Base::Bits => nats / std::f64::consts::LN_2,
        }
    }
}

impl std::str::FromStr for Base {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "nats" => Ok(Base::Nats),
            "bits" => Ok(Base::Bits),
            other => Err(invalid(format!(
                "base must be \"nats\" or \"bits\", got {other:?}"
            ))),
        }
    }
}

/// `a * b + c`: one fused instruction where the target has FMA (a libm
/// call per element otherwise, so plain arithmetic there).
#[inline(always)]
fn madd(a: f32, b: f32, c: f32) -> f32 {
    if cfg!(target_feature = "fma") {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `exp(x)` for `x <= 0` in f32: range reduction to `2^k * e^r`,
/// `|r| <= ln2/2`, and Cephes' degree-6 polynomial (about 1 ulp). Written
/// without branches or library calls so loops over a whole vocabulary
/// vectorise; `f32::exp` is a libm call per element, and these loops run on
/// every accepted token (perplexity) -- 262k elements for Gemma 3.
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Below this the result is under f32's normal range: call it zero.
    let x = x.max(-87.0);
    // Round to nearest without `floor` (a libm call unless SSE4.1 is on):
    // adding 1.5 * 2^23 leaves the integer in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let k = (x * LOG2E + ROUND) - ROUND;
    let r = madd(-k, LN2_LO, madd(-k, LN2_HI, x));
    let mut p = 1.987_569_1e-4_f32;
    p = madd(p, r, 1.398_199_9e-3);
    p = madd(p, r, 8.333_452e-3);
    p = madd(p, r, 4.166_579_6e-2);
    p = madd(p, r, 1.666_666_5e-1);
    p = madd(p, r, 0.5);
    let y = madd(p * r, r, r + 1.0);
    // 2^k without a float-to-int cast (Rust's saturating `as` does not
    // vectorise): adding 2^23 puts the integer k + 127 in the low mantissa
    // bits, and shifting those into the exponent field gives 2^k.
    let scale = f32::from_bits((k + 127.0 + 8_388_608.0).to_bits() << 23);
    let v = y * scale;
    if x <= -87.0 {
        0.0
    } else {
        v
    }
}

/// The largest non-NaN logit, if it is finite.
fn finite_max(logits: &[f32]) -> Result<f32> {
    // Lane-wise so it vectorises; NaN compares false and is skipped.
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = logits.chunks_exact(16);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = if x > *m { x } else { *m };
        }
    }
    for &x in rest {
        lanes[0] = if x > lanes[0] { x } else { lanes[0] };
    }
    let max = lanes
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    if !max.is_finite() {
        return Err(invalid(
            "logits have no finite maximum (all -inf, NaN or +inf)",
        ));
    }
    Ok(max)
}

/// `sum(exp(x - max))` and `sum(exp(x - max) * (x - max))` in one pass.
/// NaN and `-inf` entries count as zero probability. Lanes accumulate in
/// f32 over blocks of 256 elements (each term is at most 1, so a block sum
/// stays exact to ~1e-5 relative) and blocks are added in f64.
fn exp_sums(logits: &[f32], max: f32) -> (f64, f64) {
    const LANES: usize = 16;
    const BLOCK: usize = 256;
    let (mut total, mut dtotal) = (0f64, 0f64);
    for block in logits.chunks(BLOCK) {
        let mut sum = [0f32; LANES];
        let mut dsum = [0f32; LANES];
        let chunks = block.chunks_exact(LANES);
        let rest = chunks.remainder();
        for chunk in chunks {
            for lane in 0..LANES {
                let x = chunk[lane];
                // NaN compares false: it becomes -inf, i.e. zero probability.
                let d = if x >= f32::MIN {
                    x - max
                } else {
                    f32::NEG_INFINITY
                };
                let e = exp_neg(d);
                sum[lane] += e;
                dsum[lane] += if e > 0.0 { d * e } else { 0.0 };
            }
        }
        for &x in rest {
            let d = if x >= f32::MIN {
                x - max
            } else {
                f32::NEG_INFINITY
            };
            let e = exp_neg(d);
            sum[0] += e;
            dsum[0] += if e > 0.0 { d * e } else { 0.0 };
        }
        total += sum.iter().map(|&v| f64::from(v)).sum::<f64>();
        dtotal += dsum.iter().map(|&v| f64::from(v)).sum::<f64>();
    }
    (total, dtotal)
}

/// `log(sum(exp(logits)))`, computed stably. `-inf` and NaN entries count
/// as zero probability.
pub(crate) fn log_sum_exp(logits: &[f32]) -> Result<f64> {
    combine_pieces(
        logits
            .chunks(SUPER_BLOCK)
            .map(|p| piece_sum(p, crate::sampling::greedy(p))),
    )
    .ok_or_else(|| invalid("logits have no finite maximum (all -inf, NaN or +inf)"))
}

/// Elements per piece of a row in [`log_sum_exp`]: each piece is summed
/// against its own maximum, so a piece (32 KiB) is read from memory once
/// and summed while it is in the CPU cache, and pieces can go to different
/// threads with the same result (see `store::copy_with_stats`).
pub(crate) const SUPER_BLOCK: usize = 8192;

/// One piece's part of a log-sum-exp: its largest logit (the value at
/// `winner`, its greedy choice) and `sum(exp(x - max))` over it; `None`
/// without a winner (all NaN or -inf).
pub(crate) fn piece_sum(piece: &[f32], winner: Option<i32>) -> Option<(f32, f64)> {
    let max = piece[usize::try_from(winner?).ok()?];
    let sum = if max.is_finite() {
        exp_sums(piece, max).0
    } else {
        0.0
    };
    Some((max, sum))
}

/// `log(sum(exp(x)))` over consecutive pieces from their [`piece_sum`]s,
/// combined in order; `None` when the largest logit is not finite.
pub(crate) fn combine_pieces(pieces: impl Iterator<Item = Option<(f32, f64)>>) -> Option<f64> {
    let pieces: Vec<(f32, f64)> = pieces.flatten().collect();
    let max = pieces
        .iter()
        .fold(f32::NEG_INFINITY, |m, &(x, _)| if x > m { x } else { m });
    if !max.is_finite() {
        return None;
    }
    let top = f64::from(max);
    let total = pieces
        .iter()
        .fold(0.0, |t, &(m, sum)| t + sum * (f64::from(m) - top).exp());
    Some(top + total.ln())
}

/// Shannon entropy of `softmax(logits)`:
/// `H = log Z - sum(p * d)` with `d = x - max`, `Z = sum(exp(d))`.
pub fn entropy(logits: &[f32], base: Base) -> Result<f64> {
    let max = finite_max(logits)?;
    let (z, dz) = exp_sums(logits, max);
    let h = z.ln() - dz / z;
    Ok(base.scale(h.max(0.0)))
}

/// Surprisal `-log p(token)` under `softmax(logits)`.
pub fn surprisal(logits: &[f32], token: i32, base: Base) -> Result<f64> {
    let index = token_index(logits, token)?;
    let lse = log_sum_exp(logits)?;
    Ok(base.scale(lse - f64::from(logits[index])))
}

/// The `k` most likely tokens under `logits`, best first (ties: the lower
/// id first), with their log-probabilities in nats; `log_sum_exp` is the
/// row's (see `LogitStats`). NaN logits count as `-inf`. One pass with a
/// heap of `k`: no copy of the row.
pub fn top_logprobs(logits: &[f32], k: usize, log_sum_exp: f64) -> Vec<(i32, f64)> {
    use std::cmp::{Ordering, Reverse};
    use std::collections::BinaryHeap;

    /// A token as the heap orders it: by logit, then the lower id.
    #[derive(PartialEq)]
    struct Ranked(f32, Reverse<i32>);
    impl Eq for Ranked {}
    impl PartialOrd for Ranked {
        fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
            Some(self.cmp(other))
        }
    }
    impl Ord for Ranked {
        fn cmp(&self, other: &Self) -> Ordering {
            self.0.total_cmp(&other.0).then(self.1.cmp(&other.1))
        }
    }

    let k = k.min(logits.len());
    if k == 0 {
        return Vec::new();
    }
    // A min-heap of the best `k` so far: its top is the worst kept.
    let mut best: BinaryHeap<Reverse<Ranked>> = BinaryHeap::with_capacity(k + 1);
    for (i, &l) in logits.iter().enumerate() {
        let l = if l.is_nan() { f32::NEG_INFINITY } else { l };
        let item = Ranked(l, Reverse(i as i32));
        if best.len() < k {
            best.push(Reverse(item));
        } else if best.peek().is_some_and(|Reverse(worst)| item > *worst) {
            best.pop();
            best.push(Reverse(item));
        }
    }
    let mut out: Vec<(i32, f64)> = best
        .into_iter()
        .map(|Reverse(Ranked(l, Reverse(t)))| (t, f64::from(l) - log_sum_exp))
        .collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    out
}

fn token_index(logits: &[f32], token: i32) -> Result<usize> {
    usize::try_from(token)
        .ok()
        .filter(|&i| i < logits.len())
        .ok_or_else(|| {
            invalid(format!(
                "token id {token} is out of range [0, {})",
                logits.len()
            ))
        })
}

/// What accepting a token (its surprisal) and a greedy choice need from a
/// logits row. The worker finds the argmax right after a decode, while the
/// row it has just copied is still in the CPU cache, and computes the
/// log-sum-exp in the background while the caller acts on the reply (see
/// `store::Worker::rows_logits`); a later `accept` or greedy `produce`
/// then reads one value instead of scanning a cold vocabulary-sized row
/// again. The numbers are exactly those of [`surprisal`] and
/// [`crate::sampling::greedy`] (same code), whoever computes them.
#[derive(Debug, Clone)]
pub(crate) struct LogitStats {
    /// `log(sum(exp(logits)))`, `None` inside when no logit is finite (then
    /// the uncached path reports the error). Empty until the background
    /// pass or the first reader (whichever comes first) has computed it;
    /// shared by the forks that share the snapshot.
    log_sum_exp: Arc<OnceLock<Option<f64>>>,
    /// The greedy choice (lowest index of the largest logit), if asked for.
    argmax: Option<i32>,
}

impl LogitStats {
    /// Stats with `argmax` known and the log-sum-exp still to come.
    pub(crate) fn new(argmax: Option<i32>) -> Self {
        Self {
            log_sum_exp: Arc::new(OnceLock::new()),
            argmax,
        }
    }

    /// Stats of `logits` in one pass on this thread (the reference for the
    /// parallel path); the argmax only `with_argmax`.
    #[cfg(test)]
    pub(crate) fn of(logits: &[f32], with_argmax: bool) -> Self {
        let stats = Self::new(if with_argmax {
            crate::sampling::greedy(logits)
        } else {
            None
        });
        stats.fill(log_sum_exp(logits).ok());
        stats
    }

    /// Record the log-sum-exp (a no-op if a reader got there first: it
    /// computed the same bits).
    pub(crate) fn fill(&self, log_sum_exp: Option<f64>) {
        let _ = self.log_sum_exp.set(log_sum_exp);
    }

    /// The log-sum-exp if computed already (`None`: not yet).
    #[cfg(test)]
    pub(crate) fn cached_log_sum_exp(&self) -> Option<Option<f64>> {
        self.log_sum_exp.get().copied()
    }

    /// The greedy choice, when computed.
    pub(crate) fn argmax(&self) -> Option<i32> {
        self.argmax
    }

    /// The log-sum-exp of `logits`, the row these stats are of (computed
    /// now if the worker has not yet).
    pub(crate) fn log_sum_exp(&self, logits: &[f32]) -> Result<f64> {
        match *self.log_sum_exp.get_or_init(|| log_sum_exp(logits).ok()) {
            Some(lse) => Ok(lse),
            None => log_sum_exp(logits),
        }
    }

    /// [`surprisal`] of `token` under `logits`, the row these stats are of.
    pub(crate) fn surprisal(&self, logits: &[f32], token: i32, base: Base) -> Result<f64> {
        match *self.log_sum_exp.get_or_init(|| log_sum_exp(logits).ok()) {
            Some(lse) => {
                let index = token_index(logits, token)?;
                Ok(base.scale(lse - f64::from(logits[index])))
            }
            None => surprisal(logits, token, base),
        }
    }
}

/// Running perplexity: `exp(mean surprisal in nats)`; `inf` when empty.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PerplexityTracker {
    sum_nats: f64,
    count: u64,
}

impl PerplexityTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one surprisal, in nats. Negative or NaN values are rejected.
    pub fn add(&mut self, surprisal_nats: f64) -> Result<()> {
        if surprisal_nats.is_nan() || surprisal_nats < 0.0 {
            return Err(invalid(format!(
                "surprisal must be a non-negative number of nats, got {surprisal_nats}"
            )));
        }
        self.sum_nats += surprisal_nats;
        self.count += 1;
        Ok(())
    }

    pub fn perplexity(&self) -> f64 {
        if self.count == 0 {
            f64::INFINITY
        } else {
            (self.sum_nats / self.count as f64).exp()
        }
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_logprobs_match_a_full_sort() {
        let logits: Vec<f32> = (0..5000)
            .map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 10.0)
            .chain([f32::NAN, f32::NEG_INFINITY])
            .collect();
        let lse = log_sum_exp(&logits[..5000]).unwrap();
        let mut reference: Vec<(i32, f64)> = (0..logits.len() as i32)
            .map(|t| {
                let l = logits[t as usize];
                let l = if l.is_nan() { f32::NEG_INFINITY } else { l };
                (t, f64::from(l) - lse)
            })
            .collect();
        reference.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        for k in [0, 1, 2, 10, 999, 5002, 9999] {
            let got = top_logprobs(&logits, k, lse);
            assert_eq!(got, reference[..k.min(logits.len())].to_vec(), "k={k}");
        }
    }

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -86.9f32;
        while x <= 0.0 {
            let exact = f64::from(x).exp();
            let rel = ((f64::from(exp_neg(x)) - exact) / exact).abs();
            worst = worst.max(rel);
            x += 0.001_37;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_neg(0.0), 1.0);
    }

    #[test]
    fn entropy_and_lse_match_f64_reference() {
        let logits: Vec<f32> = (0..50_000)
            .map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 10.0)
            .collect();
        let max = logits.iter().copied().fold(f32::MIN, f32::max) as f64;
        let z: f64 = logits.iter().map(|&x| (f64::from(x) - max).exp()).sum();
        let lse = max + z.ln();
        let h: f64 = logits
            .iter()
            .map(|&x| {
                let lp = f64::from(x) - lse;
                -lp.exp() * lp
            })
            .sum();
        assert!((log_sum_exp(&logits).unwrap() - lse).abs() < 1e-6);
        assert!((entropy(&logits, Base::Nats).unwrap() - h).abs() < 1e-5);
    }

    #[test]
    fn cached_stats_give_the_uncached_numbers() {
        let logits: Vec<f32> = (0..49_152)
            .map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 10.0)
            .collect();
        let stats = LogitStats::of(&logits, true);
        assert_eq!(stats.argmax(), crate::sampling::greedy(&logits));
        assert_eq!(LogitStats::of(&logits, false).argmax(), None);
        for token in [0, 17, 999, 49_151] {
            assert_eq!(
                stats.surprisal(&logits, token, Base::Bits).unwrap(),
                surprisal(&logits, token, Base::Bits).unwrap()
            );
        }
        assert!(stats.surprisal(&logits, 49_152, Base::Nats).is_err());
        // No finite logit: the cache holds nothing and the error is the same.
        let bad = [f32::NAN, f32::NEG_INFINITY];
        let none = LogitStats::of(&bad, true);
        assert_eq!(none.argmax(), None);
        assert_eq!(
            none.surprisal(&bad, 0, Base::Nats).unwrap_err().to_string(),
            surprisal(&bad, 0, Base::Nats).unwrap_err().to_string()
        );
    }

    #[test]
    fn uniform_entropy_is_log_n() {
        let h = entropy(&[1.0; 8], Base::Bits).unwrap();
        assert!((h - 3.0).abs() < 1e-9);
    }

    #[test]
    fn surprisal_matches_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let lse = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        let s = surprisal(&logits, 0, Base::Nats).unwrap();
        assert!((s - (lse - 1.0)).abs() < 1e-6);
        assert!(surprisal(&logits, 3, Base::Nats).is_err());
    }

    #[test]
    fn masked_logits_are_zero_probability() {
        let h = entropy(&[0.0, f32::NEG_INFINITY, 0.0], Base::Bits).unwrap();
        assert!((h - 1.0).abs() < 1e-9);
        assert!(entropy(&[f32::NEG_INFINITY; 2], Base::Nats).is_err());
    }

    #[test]
    fn perplexity_is_exp_mean() {
        let mut t = PerplexityTracker::new();
        assert!(t.perplexity().is_infinite());
        t.add(1.0).unwrap();
        t.add(3.0).unwrap();
        assert!((t.perplexity() - 2f64.exp()).abs() < 1e-12);
        assert!(t.add(-1.0).is_err());
        assert_eq!(t.count(), 2);
    }
}
