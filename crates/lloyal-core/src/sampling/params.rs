//! Sampling parameters.

use crate::error::{invalid, Result};

/// Sampling parameters. The defaults are llama.cpp's.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f64,
    /// Keep the `top_k` most likely tokens; `0` disables.
    pub top_k: i32,
    /// Nucleus sampling; `1.0` disables.
    pub top_p: f64,
    /// Drop tokens below `min_p * p(best)`; `0.0` disables.
    pub min_p: f64,
    /// Locally typical sampling; `1.0` disables.
    pub typical_p: f64,
    /// Divide positive logits (multiply negative ones) of recent tokens; `1.0` disables.
    pub repeat_penalty: f64,
    pub frequency_penalty: f64,
    pub presence_penalty: f64,
    /// How many recent tokens the penalties look at; `0` disables, `-1` = all.
    pub penalty_last_n: i32,
    /// RNG seed; `None` draws one from the OS.
    pub seed: Option<u64>,
    /// Added to these tokens' logits before anything else.
    pub logit_bias: Vec<(i32, f32)>,
    /// Keep tokens within `n` standard deviations of the top logit; `<= 0` disables.
    pub top_n_sigma: f64,
    /// XTC: with this probability, drop every token above `xtc_threshold`
    /// except the least likely of them; `0` disables.
    pub xtc_probability: f64,
    pub xtc_threshold: f64,
    /// Mirostat: `0` off, `2` = Mirostat 2.0 (replaces top-k/p, min-p, typical).
    pub mirostat: u8,
    /// Mirostat target surprise (bits) and learning rate.
    pub mirostat_tau: f64,
    pub mirostat_eta: f64,
    /// DRY ("don't repeat yourself"): a token that would extend a repeat of
    /// an earlier sequence of `n >= dry_allowed_length` tokens loses
    /// `dry_multiplier * dry_base^(n - dry_allowed_length)` logits; `0` disables.
    pub dry_multiplier: f64,
    pub dry_base: f64,
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
        (self.temperature as f32) <= 0.0
            && !self.has_penalties()
            && !self.has_dry()
            && self.logit_bias.is_empty()
            && self.mirostat == 0
    }

    pub(super) fn has_dry(&self) -> bool {
        self.dry_multiplier > 0.0 && self.dry_penalty_last_n != 0
    }

    pub(super) fn has_penalties(&self) -> bool {
        self.penalty_last_n != 0
            && (self.repeat_penalty != 1.0
                || self.frequency_penalty != 0.0
                || self.presence_penalty != 0.0)
    }
}
