//! Information measures over a logits vector, and the running perplexity
//! that branches carry.

use crate::error::{invalid, Result};

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

/// `log(sum(exp(logits)))`, computed stably in f64. `-inf` entries count as
/// zero probability.
fn log_sum_exp(logits: &[f32]) -> Result<f64> {
    let max = logits
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY || !max.is_finite() {
        return Err(invalid(
            "logits have no finite maximum (all -inf, NaN or +inf)",
        ));
    }
    let max = f64::from(max);
    let sum: f64 = logits
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| (f64::from(x) - max).exp())
        .sum();
    Ok(max + sum.ln())
}

/// Shannon entropy of `softmax(logits)`.
pub fn entropy(logits: &[f32], base: Base) -> Result<f64> {
    let lse = log_sum_exp(logits)?;
    let h: f64 = logits
        .iter()
        .filter(|x| x.is_finite())
        .map(|&x| {
            let logp = f64::from(x) - lse;
            -logp.exp() * logp
        })
        .sum();
    Ok(base.scale(h.max(0.0)))
}

/// Surprisal `-log p(token)` under `softmax(logits)`.
pub fn surprisal(logits: &[f32], token: i32, base: Base) -> Result<f64> {
    let index = usize::try_from(token)
        .ok()
        .filter(|&i| i < logits.len())
        .ok_or_else(|| {
            invalid(format!(
                "token id {token} is out of range [0, {})",
                logits.len()
            ))
        })?;
    let lse = log_sum_exp(logits)?;
    Ok(base.scale(lse - f64::from(logits[index])))
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
    fn uniform_entropy_is_log_n() {
        let h = entropy(&[1.0; 8], Base::Bits).unwrap();
        assert!((h - 3.0).abs() < 1e-9);
    }

    #[test]
    fn surprisal_matches_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let lse = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        let s = surprisal(&logits, 0, Base::Nats).unwrap();
        assert!((s - (lse - 1.0)).abs() < 1e-12);
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
