//! The sampler: the chain from logits to a token.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::params::SamplingParams;
use crate::error::{invalid, Result};

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

/// [`Sampler::state`]'s layout: version, seed, stream, word position, mu,
/// history length, then the history.
const STATE_VERSION: u8 = 1;
const STATE_HEAD: usize = 1 + 32 + 8 + 16 + 4 + 4;

/// How much history is kept when `penalty_last_n == -1` (all tokens).
const UNBOUNDED_HISTORY: usize = 1 << 16;

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = seeded_rng(params.seed);
        Ok(Self {
            mu: 2.0 * (params.mirostat_tau as f32),
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
            self.mu = 2.0 * (params.mirostat_tau as f32);
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

    /// The sampler's running state as bytes: where its random stream is,
    /// the penalty history and mirostat's bound (not the parameters). A
    /// sampler given these bytes ([`Sampler::set_state`]) draws the same
    /// numbers from then on: how a branch moves between processes.
    pub fn state(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(STATE_HEAD + 4 * self.history.len());
        out.push(STATE_VERSION);
        out.extend_from_slice(&self.rng.get_seed());
        out.extend_from_slice(&self.rng.get_stream().to_le_bytes());
        out.extend_from_slice(&self.rng.get_word_pos().to_le_bytes());
        out.extend_from_slice(&self.mu.to_le_bytes());
        out.extend_from_slice(&(self.history.len() as u32).to_le_bytes());
        for t in &self.history {
            out.extend_from_slice(&t.to_le_bytes());
        }
        out
    }

    /// Take the state [`Sampler::state`] wrote. Malformed bytes are an
    /// error and change nothing.
    pub fn set_state(&mut self, bytes: &[u8]) -> Result<()> {
        let bad = || crate::error::invalid("not a sampler state (or one of another version)");
        if bytes.len() < STATE_HEAD || bytes[0] != STATE_VERSION {
            return Err(bad());
        }
        let field = |at: usize, n: usize| &bytes[at..at + n];
        let seed: [u8; 32] = field(1, 32).try_into().map_err(|_| bad())?;
        let stream = u64::from_le_bytes(field(33, 8).try_into().map_err(|_| bad())?);
        let word_pos = u128::from_le_bytes(field(41, 16).try_into().map_err(|_| bad())?);
        let mu = f32::from_le_bytes(field(57, 4).try_into().map_err(|_| bad())?);
        let n = u32::from_le_bytes(field(61, 4).try_into().map_err(|_| bad())?) as usize;
        if bytes.len() != STATE_HEAD + 4 * n {
            return Err(bad());
        }
        let history: VecDeque<i32> = bytes[STATE_HEAD..]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(stream);
        rng.set_word_pos(word_pos);
        self.rng = rng;
        self.mu = mu;
        self.reset_history();
        for t in history {
            self.accept(t);
        }
        Ok(())
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
        let xtc = (p.xtc_probability as f32) > 0.0
            && self.rng.random::<f32>() < (p.xtc_probability as f32);
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
            self.mu -=
                (self.params.mirostat_eta as f32) * (observed - (self.params.mirostat_tau as f32));
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
        if (p.temperature as f32) <= 0.0 {
            return argmax(&cands).map(|t| vec![(t, 1.0)]).ok_or_else(nothing);
        }
        cands.retain(|c| c.logit.is_finite() || c.logit == f32::INFINITY);
        if cands.is_empty() {
            return Err(nothing());
        }
        if p.mirostat == 2 {
            return Ok(self.mirostat_v2(cands));
        }
        if (p.top_n_sigma as f32) > 0.0 {
            top_n_sigma(&mut cands, p.top_n_sigma as f32);
        }
        let top_k = usize::try_from(p.top_k).unwrap_or(0);
        if top_k > 0 && top_k < cands.len() {
            cands.select_nth_unstable_by(top_k - 1, |a, b| b.logit.total_cmp(&a.logit));
            cands.truncate(top_k);
        }
        cands.sort_unstable_by(|a, b| b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id)));
        if (p.typical_p as f32) < 1.0 {
            typical(&mut cands, p.typical_p as f32);
        }
        if (p.top_p as f32) < 1.0 {
            let probs = softmax(&cands, 1.0);
            let mut cum = 0.0;
            let mut keep = cands.len();
            for (i, pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= f64::from(p.top_p as f32) {
                    keep = i + 1;
                    break;
                }
            }
            cands.truncate(keep.max(1));
        }
        if (p.min_p as f32) > 0.0 {
            // Sorted descending, so the first candidate is the best.
            let threshold = cands[0].logit + (p.min_p as f32).ln();
            let keep = cands.iter().take_while(|c| c.logit >= threshold).count();
            cands.truncate(keep.max(1));
        }
        if xtc {
            // Drop every token above the threshold but the least likely one.
            let probs = softmax(&cands, 1.0);
            let above = probs
                .iter()
                .take_while(|&&q| q >= f64::from(p.xtc_threshold as f32))
                .count();
            if above >= 2 {
                cands.drain(..above - 1);
            }
        }
        let probs = softmax(&cands, p.temperature as f32);
        Ok(cands.iter().map(|c| c.id).zip(probs).collect())
    }

    /// Mirostat 2.0: after temperature, keep the tokens whose surprise
    /// (bits) is within the running bound `mu`.
    fn mirostat_v2(&self, mut cands: Vec<Candidate>) -> Vec<(i32, f64)> {
        cands.sort_unstable_by(|a, b| b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id)));
        let probs = softmax(&cands, self.params.temperature as f32);
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
                c.logit -= (p.dry_multiplier as f32) * (p.dry_base as f32).powi(exponent.min(64));
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
                c.logit /= p.repeat_penalty as f32;
            } else {
                c.logit *= p.repeat_penalty as f32;
            }
            c.logit -= count as f32 * (p.frequency_penalty as f32) + (p.presence_penalty as f32);
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
