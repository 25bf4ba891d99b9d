//! Token sampling on a logits slice, in plain Rust so that a sampler (its
//! parameters, penalty history and RNG state) is ordinary data that clones
//! when a branch forks.
//!
//! The chain follows llama.cpp's default order: penalties, top-k, typical-p,
//! top-p, min-p, temperature, then a draw from the softmax. A temperature of
//! zero or below is greedy (argmax after penalties).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

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
    /// Added to these tokens' logits before anything else.
    pub logit_bias: Vec<(i32, f32)>,
    /// Keep tokens within `n` standard deviations of the top logit; `<= 0` disables.
    pub top_n_sigma: f32,
    /// XTC: with this probability, drop every token above `xtc_threshold`
    /// except the least likely of them; `0` disables.
    pub xtc_probability: f32,
    pub xtc_threshold: f32,
    /// Mirostat: `0` off, `2` = Mirostat 2.0 (replaces top-k/p, min-p, typical).
    pub mirostat: u8,
    /// Mirostat target surprise (bits) and learning rate.
    pub mirostat_tau: f32,
    pub mirostat_eta: f32,
    /// DRY ("don't repeat yourself"): a token that would extend a repeat of
    /// an earlier sequence of `n >= dry_allowed_length` tokens loses
    /// `dry_multiplier * dry_base^(n - dry_allowed_length)` logits; `0` disables.
    pub dry_multiplier: f32,
    pub dry_base: f32,
    pub dry_allowed_length: i32,
    /// How far back DRY looks; `-1` = all kept history, `0` disables.
    pub dry_penalty_last_n: i32,
    /// Text that ends a repeat (tokens containing it break matching).
    pub dry_sequence_breakers: Vec<String>,
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
            logit_bias: Vec::new(),
            top_n_sigma: -1.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: -1,
            dry_sequence_breakers: ["\n", ":", "\"", "*"].map(String::from).to_vec(),
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
        for (name, value) in [
            ("top_n_sigma", self.top_n_sigma),
            ("xtc_probability", self.xtc_probability),
            ("xtc_threshold", self.xtc_threshold),
            ("mirostat_tau", self.mirostat_tau),
            ("mirostat_eta", self.mirostat_eta),
        ] {
            if !value.is_finite() {
                return Err(invalid(format!("{name} must be finite, got {value}")));
            }
        }
        if !(0.0..=1.0).contains(&self.xtc_probability) {
            return Err(invalid("xtc_probability must be in [0, 1]"));
        }
        if self.mirostat != 0 && self.mirostat != 2 {
            return Err(invalid(format!(
                "mirostat must be 0 (off) or 2 (Mirostat 2.0), got {}",
                self.mirostat
            )));
        }
        if self.logit_bias.iter().any(|&(t, b)| t < 0 || b.is_nan()) {
            return Err(invalid(
                "logit_bias needs token ids >= 0 and non-NaN biases",
            ));
        }
        if !self.dry_multiplier.is_finite() || self.dry_multiplier < 0.0 {
            return Err(invalid("dry_multiplier must be finite and >= 0"));
        }
        if !self.dry_base.is_finite() || self.dry_base < 1.0 {
            return Err(invalid(format!(
                "dry_base must be >= 1, got {}",
                self.dry_base
            )));
        }
        if self.dry_allowed_length < 1 {
            return Err(invalid("dry_allowed_length must be >= 1"));
        }
        if self.dry_penalty_last_n < -1 {
            return Err(invalid("dry_penalty_last_n must be >= -1"));
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

    /// Whether this is plain argmax with nothing that edits the logits.
    pub(crate) fn is_plain_greedy(&self) -> bool {
        self.temperature <= 0.0
            && !self.has_penalties()
            && !self.has_dry()
            && self.logit_bias.is_empty()
            && self.mirostat == 0
    }

    fn has_dry(&self) -> bool {
        self.dry_multiplier > 0.0 && self.dry_penalty_last_n != 0
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
    /// Mirostat 2.0's running surprise bound (starts at `2 * tau`).
    mu: f32,
    /// Tokens that end a DRY match (see [`Sampler::set_dry_breakers`]).
    dry_breakers: Arc<HashSet<i32>>,
}

/// How much history is kept when `penalty_last_n == -1` (all tokens).
const UNBOUNDED_HISTORY: usize = 1 << 16;

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = seeded_rng(params.seed);
        Ok(Self {
            mu: 2.0 * params.mirostat_tau,
            params,
            history: VecDeque::new(),
            counts: HashMap::new(),
            rng,
            dry_breakers: Arc::default(),
        })
    }

    /// The token ids that end a DRY match. The context computes them from
    /// `dry_sequence_breakers` and the vocabulary (every token whose text
    /// contains a breaker); a bare sampler has none.
    pub fn set_dry_breakers(&mut self, tokens: Arc<HashSet<i32>>) {
        self.dry_breakers = tokens;
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
        if params.mirostat_tau != self.params.mirostat_tau
            || params.mirostat != self.params.mirostat
        {
            self.mu = 2.0 * params.mirostat_tau;
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

    fn dry_window(&self) -> usize {
        if !self.params.has_dry() {
            return 0;
        }
        match self.params.dry_penalty_last_n {
            -1 => UNBOUNDED_HISTORY,
            n => usize::try_from(n).unwrap_or(0),
        }
    }

    fn trim_history(&mut self) {
        let cap = self.history_cap().max(self.dry_window()).max(64);
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
        self.choose_with_probability_hint(logits, None)
    }

    /// [`Sampler::choose_with_probability`], given `greedy(logits)` when it
    /// is already known (a plain greedy sampler then skips the scan).
    pub(crate) fn choose_with_probability_hint(
        &mut self,
        logits: &[f32],
        argmax: Option<i32>,
    ) -> Result<(i32, f64)> {
        let p = &self.params;
        // XTC flips its coin before the chain runs, so `distribution` stays pure.
        let xtc = p.xtc_probability > 0.0 && self.rng.random::<f32>() < p.xtc_probability;
        let dist = match argmax {
            Some(t) if p.is_plain_greedy() && !logits.is_empty() => vec![(t, 1.0)],
            _ => self.chain(logits, xtc)?,
        };
        let chosen = if dist.len() == 1 {
            dist[0]
        } else {
            let r: f64 = self.rng.random();
            let mut cum = 0.0;
            let mut chosen = dist[dist.len() - 1];
            for &(id, pr) in &dist {
                cum += pr;
                if r < cum {
                    chosen = (id, pr);
                    break;
                }
            }
            chosen
        };
        if self.params.mirostat == 2 {
            // Move the bound towards the target surprise (in bits).
            let observed = -(chosen.1.max(f64::MIN_POSITIVE)).log2() as f32;
            self.mu -= self.params.mirostat_eta * (observed - self.params.mirostat_tau);
        }
        Ok(chosen)
    }

    /// The distribution a draw would come from: `(token, probability)` pairs
    /// after bias, penalties, the filters and the temperature, most likely
    /// first (XTC, which is random per draw, is left out). Greedy parameters
    /// give a single pair with probability 1.
    pub fn distribution(&self, logits: &[f32]) -> Result<Vec<(i32, f64)>> {
        self.chain(logits, false)
    }

    fn chain(&self, logits: &[f32], xtc: bool) -> Result<Vec<(i32, f64)>> {
        let nothing = || invalid("every logit is -inf or NaN: nothing can be sampled");
        if logits.is_empty() {
            return Err(invalid("cannot sample from empty logits"));
        }
        let p = &self.params;
        if p.is_plain_greedy() {
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
        for &(t, b) in &p.logit_bias {
            let c = usize::try_from(t)
                .ok()
                .and_then(|i| cands.get_mut(i))
                .ok_or_else(|| {
                    invalid(format!(
                        "logit_bias token {t} is out of range [0, {})",
                        logits.len()
                    ))
                })?;
            c.logit += b;
        }
        self.apply_penalties(&mut cands);
        self.apply_dry(&mut cands);
        if p.temperature <= 0.0 {
            return argmax(&cands).map(|t| vec![(t, 1.0)]).ok_or_else(nothing);
        }
        cands.retain(|c| c.logit.is_finite() || c.logit == f32::INFINITY);
        if cands.is_empty() {
            return Err(nothing());
        }
        if p.mirostat == 2 {
            return Ok(self.mirostat_v2(cands));
        }
        if p.top_n_sigma > 0.0 {
            top_n_sigma(&mut cands, p.top_n_sigma);
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
        if xtc {
            // Drop every token above the threshold but the least likely one.
            let probs = softmax(&cands, 1.0);
            let above = probs
                .iter()
                .take_while(|&&q| q >= f64::from(p.xtc_threshold))
                .count();
            if above >= 2 {
                cands.drain(..above - 1);
            }
        }
        let probs = softmax(&cands, p.temperature);
        Ok(cands.iter().map(|c| c.id).zip(probs).collect())
    }

    /// Mirostat 2.0: after temperature, keep the tokens whose surprise
    /// (bits) is within the running bound `mu`.
    fn mirostat_v2(&self, mut cands: Vec<Candidate>) -> Vec<(i32, f64)> {
        cands.sort_unstable_by(|a, b| b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id)));
        let probs = softmax(&cands, self.params.temperature);
        let keep = probs
            .iter()
            .take_while(|&&q| -q.log2() <= f64::from(self.mu))
            .count()
            .max(1);
        let kept = &probs[..keep];
        let total: f64 = kept.iter().sum();
        cands[..keep]
            .iter()
            .zip(kept)
            .map(|(c, &q)| (c.id, q / total))
            .collect()
    }

    /// Mirostat's current surprise bound, in bits.
    pub fn mirostat_mu(&self) -> f32 {
        self.mu
    }

    /// DRY: for each earlier occurrence of a token, how many tokens before
    /// it repeat the tokens before now; the longest repeat each token would
    /// extend sets its penalty. Breaker tokens stop a match.
    fn apply_dry(&self, cands: &mut [Candidate]) {
        let p = &self.params;
        let window = self.dry_window();
        let n = self.history.len().min(window);
        let allowed = p.dry_allowed_length as usize;
        if n < allowed + 1 {
            return;
        }
        let start = self.history.len() - n;
        let h: Vec<i32> = self.history.iter().skip(start).copied().collect();
        let last = n - 1;
        if self.dry_breakers.contains(&h[last]) {
            return;
        }
        let mut longest: HashMap<i32, usize> = HashMap::new();
        for i in 1..n {
            // h[..i] ends with k tokens equal to the end of h.
            let mut k = 0;
            while k < i && h[i - 1 - k] == h[last - k] && !self.dry_breakers.contains(&h[last - k])
            {
                k += 1;
            }
            if k >= allowed {
                let e = longest.entry(h[i]).or_insert(0);
                *e = (*e).max(k);
            }
        }
        for (token, k) in longest {
            if self.dry_breakers.contains(&token) {
                continue;
            }
            if let Some(c) = usize::try_from(token).ok().and_then(|i| cands.get_mut(i)) {
                let exponent = (k - allowed) as i32;
                c.logit -= p.dry_multiplier * p.dry_base.powi(exponent.min(64));
            }
        }
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

/// Keep candidates whose logit is within `n` standard deviations of the
/// best (top-n-sigma, Tang et al. 2024).
fn top_n_sigma(cands: &mut Vec<Candidate>, n: f32) {
    let len = cands.len() as f64;
    let mean = cands.iter().map(|c| f64::from(c.logit)).sum::<f64>() / len;
    let var = cands
        .iter()
        .map(|c| (f64::from(c.logit) - mean).powi(2))
        .sum::<f64>()
        / len;
    let max = cands
        .iter()
        .map(|c| c.logit)
        .fold(f32::NEG_INFINITY, f32::max);
    let threshold = f64::from(max) - f64::from(n) * var.sqrt();
    cands.retain(|c| f64::from(c.logit) >= threshold);
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

    fn wide() -> Vec<f32> {
        (0..100).map(|i| i as f32 / 10.0).collect()
    }

    #[test]
    fn logit_bias_moves_the_argmax() {
        let mut s = Sampler::new(SamplingParams {
            logit_bias: vec![(0, 100.0)],
            ..SamplingParams::greedy()
        })
        .unwrap();
        assert_eq!(s.choose(&logits()).unwrap(), 0);
        let mut bad = Sampler::new(SamplingParams {
            logit_bias: vec![(99, 1.0)],
            ..SamplingParams::greedy()
        })
        .unwrap();
        assert!(bad.choose(&logits()).is_err());
    }

    #[test]
    fn top_n_sigma_keeps_only_the_head() {
        let s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            top_n_sigma: 0.5,
            ..SamplingParams::default()
        })
        .unwrap();
        let dist = s.distribution(&wide()).unwrap();
        // Logits 0..9.9 have std ~2.89: keep those >= 9.9 - 1.44.
        assert!(dist.iter().all(|&(t, _)| t >= 85), "{dist:?}");
        assert!(dist.len() >= 10);
    }

    #[test]
    fn xtc_removes_the_top_choices() {
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            xtc_probability: 1.0,
            xtc_threshold: 0.1,
            seed: Some(3),
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(params).unwrap();
        let logits = [5.0f32, 4.9, 4.8, 0.0, 0.0];
        // The three ~33% tokens are above 0.1; only the least likely stays.
        for _ in 0..50 {
            let t = s.choose(&logits).unwrap();
            assert!(t == 2 || t >= 3, "got {t}");
        }
    }

    #[test]
    fn mirostat_v2_tracks_its_target() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            mirostat: 2,
            mirostat_tau: 3.0,
            mirostat_eta: 0.5,
            seed: Some(5),
            ..SamplingParams::default()
        })
        .unwrap();
        assert_eq!(s.mirostat_mu(), 6.0);
        let logits = wide();
        let mut surprise = 0.0;
        let n = 400;
        for _ in 0..n {
            let (_, p) = s.choose_with_probability(&logits).unwrap();
            surprise += -p.log2();
        }
        let mean = surprise / n as f64;
        assert!((mean - 3.0).abs() < 0.5, "mean surprise {mean}");
        // Every draw stays under the bound: the truncation is real.
        assert!(s.distribution(&logits).unwrap().len() < 100);
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

    #[test]
    fn dry_penalizes_the_token_that_extends_a_repeat() {
        let params = SamplingParams {
            dry_multiplier: 1.0,
            dry_allowed_length: 2,
            ..SamplingParams::greedy()
        };
        let mut logits = vec![0.0f32; 16];
        logits[8] = 1.0; // would continue 5 6 7 -> 8
        logits[9] = 0.9;
        let mut s = Sampler::new(params.clone()).unwrap();
        for t in [5, 6, 7, 8, 5, 6, 7] {
            s.accept(t);
        }
        assert_eq!(s.choose(&logits).unwrap(), 9);
        // Without DRY, or with 6 as a breaker (the repeat is then 1 token), 8 wins.
        let mut plain = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(plain.choose(&logits).unwrap(), 8);
        s.set_dry_breakers(Arc::new([6].into_iter().collect()));
        assert_eq!(s.choose(&logits).unwrap(), 8);
        // The penalty grows with the repeat's length.
        let mut long = Sampler::new(params).unwrap();
        for t in [1, 2, 3, 4, 8, 1, 2, 3, 4] {
            long.accept(t);
        }
        let d = long.distribution(&logits).unwrap();
        assert_eq!(d[0].0, 9);
    }
}
