//! Token sampling on a logits slice, in plain Rust so that a sampler (its
//! parameters, penalty history and RNG state) is ordinary data that clones
//! when a branch forks.
//!
//! The chain follows llama.cpp's default order: penalties, top-k, typical-p,
//! top-p, min-p, temperature, then a draw from the softmax. A temperature of
//! zero or below is greedy (argmax after penalties).

use std::collections::{HashMap, VecDeque};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{invalid, Result};

/// Sampling parameters. The defaults are llama.cpp's.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; `0` disables.
    pub top_k: i32,
    /// Nucleus sampling; `1.0` disables.
    pub top_p: f32,
    /// Drop tokens below `min_p * p(best)`; `0.0` disables.
    pub min_p: f32,
    /// Locally typical sampling; `1.0` disables.
    pub typical_p: f32,
    /// Divide positive logits (multiply negative ones) of recent tokens; `1.0` disables.
    pub repeat_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// How many recent tokens the penalties look at; `0` disables, `-1` = all.
    pub penalty_last_n: i32,
    /// RNG seed; `None` draws one from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            typical_p: 1.0,
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            penalty_last_n: 64,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: always the most likely token.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Reject values no sampler can use.
    pub fn validate(&self) -> Result<()> {
        let finite = [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("typical_p", self.typical_p),
            ("repeat_penalty", self.repeat_penalty),
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ];
        for (name, value) in finite {
            if !value.is_finite() {
                return Err(invalid(format!("{name} must be finite, got {value}")));
            }
        }
        for (name, value) in [
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("typical_p", self.typical_p),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(invalid(format!("{name} must be in [0, 1], got {value}")));
            }
        }
        if self.top_k < 0 {
            return Err(invalid(format!("top_k must be >= 0, got {}", self.top_k)));
        }
        if self.repeat_penalty <= 0.0 {
            return Err(invalid(format!(
                "repeat_penalty must be > 0, got {}",
                self.repeat_penalty
            )));
        }
        if self.penalty_last_n < -1 {
            return Err(invalid(format!(
                "penalty_last_n must be >= -1, got {}",
                self.penalty_last_n
            )));
        }
        Ok(())
    }

    fn has_penalties(&self) -> bool {
        self.penalty_last_n != 0
            && (self.repeat_penalty != 1.0
                || self.frequency_penalty != 0.0
                || self.presence_penalty != 0.0)
    }
}

/// A candidate token during sampling.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    id: i32,
    logit: f32,
}

/// A sampler: parameters, the recent-token history the penalties read, and
/// the RNG. Cloning it clones the random stream: a clone draws the same
/// numbers as the original until one of them is reseeded.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    history: VecDeque<i32>,
    counts: HashMap<i32, u32>,
    rng: ChaCha8Rng,
}

/// How much history is kept when `penalty_last_n == -1` (all tokens).
const UNBOUNDED_HISTORY: usize = 1 << 16;

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = seeded_rng(params.seed);
        Ok(Self {
            params,
            history: VecDeque::new(),
            counts: HashMap::new(),
            rng,
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Change parameters, keeping the penalty history. The RNG is reseeded
    /// only when the new parameters name a different seed.
    pub fn set_params(&mut self, params: SamplingParams) -> Result<()> {
        params.validate()?;
        if params.seed != self.params.seed {
            self.rng = seeded_rng(params.seed);
        }
        self.params = params;
        self.trim_history();
        Ok(())
    }

    /// Restart the random stream from `seed`.
    pub fn reseed(&mut self, seed: u64) {
        self.params.seed = Some(seed);
        self.rng = ChaCha8Rng::seed_from_u64(seed);
    }

    /// Record a token in the penalty history (what llama.cpp calls accept).
    pub fn accept(&mut self, token: i32) {
        self.history.push_back(token);
        *self.counts.entry(token).or_insert(0) += 1;
        self.trim_history();
    }

    /// Forget the penalty history.
    pub fn reset_history(&mut self) {
        self.history.clear();
        self.counts.clear();
    }

    fn history_cap(&self) -> usize {
        match self.params.penalty_last_n {
            -1 => UNBOUNDED_HISTORY,
            n => usize::try_from(n).unwrap_or(0),
        }
    }

    fn trim_history(&mut self) {
        let cap = self.history_cap().max(64);
        while self.history.len() > cap {
            if let Some(old) = self.history.pop_front() {
                if let Some(c) = self.counts.get_mut(&old) {
                    *c -= 1;
                    if *c == 0 {
                        self.counts.remove(&old);
                    }
                }
            }
        }
    }

    /// Choose a token from `logits` and accept it into the history.
    pub fn sample(&mut self, logits: &[f32]) -> Result<i32> {
        let token = self.choose(logits)?;
        self.accept(token);
        Ok(token)
    }

    /// Choose a token without recording it.
    pub fn choose(&mut self, logits: &[f32]) -> Result<i32> {
        self.choose_with_probability(logits).map(|(token, _)| token)
    }

    /// Choose a token without recording it; also return the probability it
    /// had in the distribution it was drawn from (after every filter and the
    /// temperature). Greedy choices have probability 1.
    pub fn choose_with_probability(&mut self, logits: &[f32]) -> Result<(i32, f64)> {
        let dist = self.distribution(logits)?;
        if dist.len() == 1 {
            return Ok(dist[0]);
        }
        let r: f64 = self.rng.random();
        let mut cum = 0.0;
        for &(id, pr) in &dist {
            cum += pr;
            if r < cum {
                return Ok((id, pr));
            }
        }
        Ok(dist[dist.len() - 1])
    }

    /// The distribution a draw would come from: `(token, probability)` pairs
    /// after penalties, the filters and the temperature, most likely first.
    /// Greedy parameters give a single pair with probability 1.
    pub fn distribution(&self, logits: &[f32]) -> Result<Vec<(i32, f64)>> {
        let nothing = || invalid("every logit is -inf or NaN: nothing can be sampled");
        if logits.is_empty() {
            return Err(invalid("cannot sample from empty logits"));
        }
        if self.params.temperature <= 0.0 && !self.params.has_penalties() {
            return greedy(logits).map(|t| vec![(t, 1.0)]).ok_or_else(nothing);
        }
        let mut cands: Vec<Candidate> = logits
            .iter()
            .enumerate()
            .map(|(i, &logit)| Candidate {
                id: i as i32,
                logit,
            })
            .collect();
        self.apply_penalties(&mut cands);
        let p = &self.params;
        if p.temperature <= 0.0 {
            return argmax(&cands).map(|t| vec![(t, 1.0)]).ok_or_else(nothing);
        }
        cands.retain(|c| c.logit.is_finite() || c.logit == f32::INFINITY);
        if cands.is_empty() {
            return Err(nothing());
        }
        let top_k = usize::try_from(p.top_k).unwrap_or(0);
        if top_k > 0 && top_k < cands.len() {
            cands.select_nth_unstable_by(top_k - 1, |a, b| b.logit.total_cmp(&a.logit));
            cands.truncate(top_k);
        }
        cands.sort_unstable_by(|a, b| b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id)));
        if p.typical_p < 1.0 {
            typical(&mut cands, p.typical_p);
        }
        if p.top_p < 1.0 {
            let probs = softmax(&cands, 1.0);
            let mut cum = 0.0;
            let mut keep = cands.len();
            for (i, pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
            cands.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            // Sorted descending, so the first candidate is the best.
            let threshold = cands[0].logit + p.min_p.ln();
            let keep = cands.iter().take_while(|c| c.logit >= threshold).count();
            cands.truncate(keep.max(1));
        }
        let probs = softmax(&cands, p.temperature);
        Ok(cands.iter().map(|c| c.id).zip(probs).collect())
    }

    fn apply_penalties(&self, cands: &mut [Candidate]) {
        let p = &self.params;
        if !p.has_penalties() || self.counts.is_empty() {
            return;
        }
        let window = self.history_cap();
        // Counts cover the retained history; recount when the window is
        // narrower than what is kept.
        let recent: HashMap<i32, u32>;
        let counts = if self.history.len() > window {
            let mut m = HashMap::new();
            for &t in self.history.iter().rev().take(window) {
                *m.entry(t).or_insert(0) += 1;
            }
            recent = m;
            &recent
        } else {
            &self.counts
        };
        for (&token, &count) in counts {
            let Some(c) = usize::try_from(token).ok().and_then(|i| cands.get_mut(i)) else {
                continue;
            };
            if c.logit > 0.0 {
                c.logit /= p.repeat_penalty;
            } else {
                c.logit *= p.repeat_penalty;
            }
            c.logit -= count as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
}

fn seeded_rng(seed: Option<u64>) -> ChaCha8Rng {
    match seed {
        Some(s) => ChaCha8Rng::seed_from_u64(s),
        None => ChaCha8Rng::from_os_rng(),
    }
}

fn argmax(cands: &[Candidate]) -> Option<i32> {
    let mut best: Option<Candidate> = None;
    for c in cands {
        if c.logit.is_nan() {
            continue;
        }
        if best.is_none_or(|b| c.logit > b.logit) {
            best = Some(*c);
        }
    }
    best.filter(|b| b.logit > f32::NEG_INFINITY).map(|b| b.id)
}

/// Index of the largest logit above `-inf` (lowest index on ties; NaN is
/// skipped). `None` when there is no such logit. Lane-wise so the scan over
/// a whole vocabulary vectorises.
pub fn greedy(logits: &[f32]) -> Option<i32> {
    const LANES: usize = 16;
    let mut best = [f32::NEG_INFINITY; LANES];
    let mut at = [u32::MAX; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest_start = logits.len() - chunks.remainder().len();
    for (c, chunk) in chunks.enumerate() {
        let base = (c * LANES) as u32;
        for lane in 0..LANES {
            let x = chunk[lane];
            // Strictly greater: the first (lowest) index wins ties; NaN never wins.
            let better = x > best[lane];
            best[lane] = if better { x } else { best[lane] };
            at[lane] = if better { base + lane as u32 } else { at[lane] };
        }
    }
    let mut winner: Option<(f32, u32)> = None;
    let candidates = best.iter().zip(&at).map(|(&v, &i)| (v, i)).chain(
        logits[rest_start..]
            .iter()
            .enumerate()
            .map(|(j, &v)| (v, (rest_start + j) as u32)),
    );
    for (v, i) in candidates {
        if i == u32::MAX || v.is_nan() || v == f32::NEG_INFINITY {
            continue;
        }
        winner = match winner {
            Some((bv, bi)) if bv > v || (bv == v && bi < i) => Some((bv, bi)),
            _ => Some((v, i)),
        };
    }
    winner.map(|(_, i)| i as i32)
}

/// Softmax of the candidates' logits divided by `temperature`, in f64.
fn softmax(cands: &[Candidate], temperature: f32) -> Vec<f64> {
    let t = f64::from(temperature);
    let max = cands
        .iter()
        .map(|c| f64::from(c.logit))
        .fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = cands
        .iter()
        .map(|c| ((f64::from(c.logit) - max) / t).exp())
        .collect();
    let sum: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

/// Locally typical sampling (Meister et al.): keep the tokens whose
/// surprisal is closest to the entropy until their mass reaches `p`.
fn typical(cands: &mut Vec<Candidate>, p: f32) {
    let probs = softmax(cands, 1.0);
    let entropy: f64 = probs
        .iter()
        .filter(|&&q| q > 0.0)
        .map(|&q| -q * q.ln())
        .sum();
    let mut order: Vec<usize> = (0..cands.len()).collect();
    let shift = |i: usize| (-probs[i].ln() - entropy).abs();
    order.sort_by(|&a, &b| shift(a).total_cmp(&shift(b)));
    let mut cum = 0.0;
    let mut keep = order.len();
    for (n, &i) in order.iter().enumerate() {
        cum += probs[i];
        if cum >= f64::from(p) {
            keep = n + 1;
            break;
        }
    }
    let mut kept: Vec<Candidate> = order[..keep.max(1)].iter().map(|&i| cands[i]).collect();
    kept.sort_unstable_by(|a, b| b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id)));
    *cands = kept;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![0.0, 3.0, 1.0, 2.5, -1.0]
    }

    #[test]
    fn greedy_scan_matches_a_plain_argmax() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32).collect();
        let plain = logits
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
            .0 as i32;
        assert_eq!(greedy(&logits), Some(plain));
        let mut tail = vec![0.0f32; 35];
        tail[34] = 1.0;
        assert_eq!(greedy(&tail), Some(34));
        assert_eq!(greedy(&[f32::NAN, 2.0, 2.0]), Some(1));
        assert_eq!(greedy(&[f32::NEG_INFINITY; 40]), None);
    }

    #[test]
    fn greedy_takes_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&logits()).unwrap(), 1);
    }

    #[test]
    fn repeat_penalty_changes_the_argmax() {
        let mut s = Sampler::new(SamplingParams {
            repeat_penalty: 2.0,
            ..SamplingParams::greedy()
        })
        .unwrap();
        s.accept(1);
        // 3.0 / 2 = 1.5 < 2.5
        assert_eq!(s.choose(&logits()).unwrap(), 3);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 1,
            seed: Some(7),
            ..SamplingParams::default()
        })
        .unwrap();
        for _ in 0..20 {
            assert_eq!(s.choose(&logits()).unwrap(), 1);
        }
    }

    #[test]
    fn same_seed_same_stream_and_clones_share_it() {
        let params = SamplingParams {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: Some(42),
            ..SamplingParams::default()
        };
        let mut a = Sampler::new(params.clone()).unwrap();
        let mut b = Sampler::new(params).unwrap();
        let draws_a: Vec<i32> = (0..32).map(|_| a.choose(&logits()).unwrap()).collect();
        let mut c = a.clone();
        let draws_b: Vec<i32> = (0..32).map(|_| b.choose(&logits()).unwrap()).collect();
        assert_eq!(draws_a, draws_b);
        assert_eq!(a.choose(&logits()).unwrap(), c.choose(&logits()).unwrap());
        // Not all the same token: the draw is really random.
        assert!(draws_a.iter().any(|&t| t != draws_a[0]));
    }

    #[test]
    fn min_p_keeps_only_near_best() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.5,
            seed: Some(1),
            ..SamplingParams::default()
        })
        .unwrap();
        // p(3)/p(1) = exp(-0.5) ~ 0.61 >= 0.5; everything else is dropped.
        for _ in 0..50 {
            let t = s.choose(&logits()).unwrap();
            assert!(t == 1 || t == 3, "got {t}");
        }
    }

    #[test]
    fn invalid_params_are_rejected() {
        assert!(Sampler::new(SamplingParams {
            top_p: 1.5,
            ..SamplingParams::default()
        })
        .is_err());
        assert!(Sampler::new(SamplingParams {
            temperature: f32::NAN,
            ..SamplingParams::default()
        })
        .is_err());
    }

    #[test]
    fn all_neg_inf_is_an_error() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert!(s.choose(&[f32::NEG_INFINITY; 3]).is_err());
        let mut g = Sampler::new(SamplingParams::greedy()).unwrap();
        assert!(g.choose(&[f32::NEG_INFINITY; 3]).is_err());
    }
}
