//! A branch's next-token distribution, read off the branch: top tokens,
//! log-probabilities and entropy without the branches lock.

use std::sync::Arc;

use crate::error::{invalid, Result};
use crate::metrics::{self, Base, LogitStats};

/// A branch's logits snapshot and the stats the worker computed with it,
/// read off the branch (see [`BranchState::logits_view`](super::BranchState::logits_view)).
#[derive(Debug, Clone)]
pub struct LogitsView {
    pub(super) logits: Arc<[f32]>,
    pub(super) stats: Option<LogitStats>,
}

impl LogitsView {
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    fn log_sum_exp(&self) -> Result<f64> {
        match &self.stats {
            Some(stats) => stats.log_sum_exp(&self.logits),
            None => metrics::log_sum_exp(&self.logits),
        }
    }

    /// The `k` most likely next tokens, best first, with their
    /// log-probabilities in nats (see [`metrics::top_logprobs`]).
    pub fn top_logprobs(&self, k: usize) -> Result<Vec<(i32, f64)>> {
        Ok(metrics::top_logprobs(&self.logits, k, self.log_sum_exp()?))
    }

    /// Log-probabilities in nats of `tokens` (valid ids: see
    /// `Model::check_tokens`).
    pub fn logprobs(&self, tokens: &[i32]) -> Result<Vec<f64>> {
        let lse = self.log_sum_exp()?;
        tokens
            .iter()
            .map(|&t| {
                let l = usize::try_from(t)
                    .ok()
                    .and_then(|i| self.logits.get(i))
                    .ok_or_else(|| invalid(format!("token id {t} is out of range")))?;
                Ok(f64::from(*l) - lse)
            })
            .collect()
    }

    pub fn entropy(&self, base: Base) -> Result<f64> {
        metrics::entropy(&self.logits, base)
    }
}
