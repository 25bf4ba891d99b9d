//! What a branch is: plain data -- sampler (with its RNG), logits
//! snapshot, metrics, biases, position -- so forking is cloning.

use std::sync::Arc;

use crate::error::{invalid, Error, Result};
use crate::grammar::Grammar;
use crate::metrics::{self, Base, LogitStats, PerplexityTracker};
use crate::sampling::{Sampler, SamplingParams};

use super::id::BranchId;
use super::view::LogitsView;

/// What a branch carries. Cloned on fork, except `steer` (per-branch) and
/// the topology fields.
#[derive(Debug, Clone)]
pub struct BranchState {
    /// The KV sequence this branch leases.
    pub(crate) seq: i32,
    /// The next position to decode at (= tokens in this branch's KV).
    pub position: i32,
    /// Position when this branch was forked (0 for a root).
    pub fork_head: i32,
    pub(crate) sampler: Sampler,
    /// Logits after the last decode (shared until someone edits them).
    pub(crate) logits: Option<Arc<[f32]>>,
    /// Of `logits`, when the worker computed them with the snapshot.
    logit_stats: Option<LogitStats>,
    /// Biases added before sampling; inherited by forks.
    pub logit_bias: Arc<Vec<(i32, f32)>>,
    /// Biases for this branch only; not inherited.
    pub steer: Vec<(i32, f32)>,
    /// The grammar constraining what this branch may produce; forks clone it.
    pub(crate) grammar: Option<Grammar>,
    /// Model perplexity: surprisal of accepted tokens under the raw logits.
    pub perplexity: PerplexityTracker,
    /// Surprisal of accepted tokens under the sampling distribution.
    pub sampling_perplexity: PerplexityTracker,
    /// The last produced token and its sampling probability, so accepting
    /// it does not run the sampler chain twice.
    last_produced: Option<(i32, f64)>,
    pub parent: Option<BranchId>,
    pub children: Vec<BranchId>,
    /// An operation on this branch is queued or running on the worker.
    pub(crate) busy: bool,
    /// Forks of this branch queued or running: they only read it, so
    /// several may be in flight at once, but nothing may change it meanwhile.
    pub(crate) forks: u32,
    /// Every position's logits from the last `prefill` that asked for them
    /// (`n * vocab`, row-major), until taken. Not inherited by forks.
    pub(crate) rows: Option<Vec<f32>>,
    /// The LoRA adapters and control vector its decodes run under;
    /// inherited by forks (see `adapter`). Set only through
    /// `Context::branch_set_adapters`, which checks it.
    pub(crate) adapters: crate::adapter::Adapters,
}

impl BranchState {
    pub(crate) fn new(seq: i32, params: SamplingParams) -> Result<Self> {
        Ok(Self {
            seq,
            position: 0,
            fork_head: 0,
            sampler: Sampler::new(params)?,
            logits: None,
            logit_stats: None,
            logit_bias: Arc::new(Vec::new()),
            steer: Vec::new(),
            grammar: None,
            perplexity: PerplexityTracker::new(),
            sampling_perplexity: PerplexityTracker::new(),
            last_produced: None,
            parent: None,
            children: Vec::new(),
            busy: false,
            forks: 0,
            rows: None,
            adapters: Default::default(),
        })
    }

    /// The state a fork starts from.
    pub(crate) fn fork(&self, seq: i32, parent: BranchId) -> Self {
        let mut child = self.clone();
        child.seq = seq;
        child.fork_head = self.position;
        child.steer.clear();
        child.parent = Some(parent);
        child.children.clear();
        child.busy = false;
        child.forks = 0;
        child.rows = None;
        child
    }

    pub fn logits(&self) -> Result<&Arc<[f32]>> {
        self.logits
            .as_ref()
            .ok_or_else(|| invalid("the branch has no logits yet: prefill it first"))
    }

    /// Whether an operation on this branch (a fork included) is queued or
    /// running.
    pub fn is_busy(&self) -> bool {
        self.busy || self.forks > 0
    }

    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    pub fn sampler_mut(&mut self) -> &mut Sampler {
        self.last_produced = None;
        &mut self.sampler
    }

    pub(crate) fn set_logits(&mut self, logits: Arc<[f32]>) {
        self.replace_logits(logits);
    }

    pub(crate) fn clear_logits(&mut self) {
        self.last_produced = None;
        self.logits = None;
        self.logit_stats = None;
    }

    /// Install a new snapshot and hand back the old one.
    pub(crate) fn replace_logits(&mut self, logits: Arc<[f32]>) -> Option<Arc<[f32]>> {
        self.replace_logits_with(logits, None)
    }

    /// [`BranchState::replace_logits`], with the new snapshot's stats when
    /// they are already computed.
    pub(crate) fn replace_logits_with(
        &mut self,
        logits: Arc<[f32]>,
        stats: Option<LogitStats>,
    ) -> Option<Arc<[f32]>> {
        self.last_produced = None;
        self.logit_stats = stats;
        self.logits.replace(logits)
    }

    /// Surprisal of `token` under the snapshot (the model's distribution),
    /// from the stats the worker computed with it when there are some.
    pub fn model_surprisal(&self, token: i32, base: Base) -> Result<f64> {
        let logits = self.logits()?;
        match &self.logit_stats {
            Some(stats) => stats.surprisal(logits, token, base),
            None => metrics::surprisal(logits, token, base),
        }
    }

    /// The snapshot with its stats: cheap (two reference counts), so that
    /// a caller can compute on it without holding the branches lock.
    pub fn logits_view(&self) -> Result<LogitsView> {
        Ok(LogitsView {
            logits: Arc::clone(self.logits()?),
            stats: self.logit_stats.clone(),
        })
    }

    /// Whether `produce` is a plain argmax of the snapshot (greedy sampler;
    /// no bias, steering or grammar), so the worker precomputes it.
    pub(crate) fn produces_argmax(&self) -> bool {
        self.sampler.params().is_plain_greedy() && !self.edits_logits()
    }

    /// Whether sampling the next token costs enough that an event loop
    /// should not wait for it on its own thread: a sort or scan of the
    /// whole vocabulary (`top_k` 0 or over 1024, mirostat) or a grammar
    /// mask. On Gemma 3's 262k vocabulary `top_k=0` takes about 9 ms, the
    /// default `top_k=40` about 0.5 ms.
    pub(crate) fn produce_is_slow(&self) -> bool {
        if self.produces_argmax() {
            return false;
        }
        let p = self.sampler.params();
        self.grammar.as_ref().is_some_and(Grammar::constrains)
            || (!p.is_plain_greedy() && (p.top_k <= 0 || p.top_k > 1024 || p.mirostat != 0))
    }

    /// Whether sampling sees the snapshot edited (bias, steering, grammar).
    fn edits_logits(&self) -> bool {
        !self.logit_bias.is_empty()
            || !self.steer.is_empty()
            || self.grammar.as_ref().is_some_and(Grammar::constrains)
    }

    /// The logits sampling sees: the snapshot plus bias and steer, with
    /// the tokens the grammar forbids at -inf.
    fn sampling_logits(&mut self) -> Result<std::borrow::Cow<'_, [f32]>> {
        let logits = self
            .logits
            .as_ref()
            .ok_or_else(|| invalid("the branch has no logits yet: prefill it first"))?;
        if !self.edits_logits() {
            return Ok(std::borrow::Cow::Borrowed(logits));
        }
        let mut edited = logits.to_vec();
        for &(t, b) in self.logit_bias.iter().chain(&self.steer) {
            if let Some(l) = usize::try_from(t).ok().and_then(|i| edited.get_mut(i)) {
                *l += b;
            }
        }
        if let Some(g) = self.grammar.as_mut() {
            g.apply(&mut edited)?;
        }
        Ok(std::borrow::Cow::Owned(edited))
    }

    /// Sample the next token (the RNG advances; nothing is accepted).
    pub fn produce(&mut self) -> Result<i32> {
        // Borrow the snapshot (an Arc clone, not a copy) unless it is edited.
        let logits = match self.sampling_logits()? {
            std::borrow::Cow::Owned(edited) => Some(edited),
            std::borrow::Cow::Borrowed(_) => None,
        };
        let snapshot;
        let view: &[f32] = match &logits {
            Some(edited) => edited,
            None => {
                snapshot = Arc::clone(self.logits()?);
                &snapshot
            }
        };
        let argmax = match &logits {
            None => self.logit_stats.as_ref().and_then(LogitStats::argmax),
            Some(_) => None, // edited logits: the cached argmax is not theirs
        };
        let (token, prob) = self.sampler.choose_with_probability_hint(view, argmax)?;
        self.last_produced = Some((token, prob));
        Ok(token)
    }

    /// What `produce` needs, taken off this branch (which the caller marks
    /// busy) so that sampling can run without the branches lock: clones of
    /// the sampler, snapshot and biases, and the grammar itself. Give it
    /// back with [`BranchState::reattach`].
    pub(crate) fn detach_for_produce(&mut self) -> BranchState {
        BranchState {
            seq: self.seq,
            position: self.position,
            fork_head: self.fork_head,
            sampler: self.sampler.clone(),
            logits: self.logits.clone(),
            logit_stats: self.logit_stats.clone(),
            logit_bias: Arc::clone(&self.logit_bias),
            steer: self.steer.clone(),
            grammar: self.grammar.take(),
            perplexity: PerplexityTracker::default(),
            sampling_perplexity: PerplexityTracker::default(),
            last_produced: None,
            parent: None,
            children: Vec::new(),
            busy: false,
            forks: 0,
            rows: None,
            adapters: Default::default(),
        }
    }

    /// Take back what [`BranchState::detach_for_produce`] took, as `produce`
    /// left it (the random stream advanced).
    pub(crate) fn reattach(&mut self, detached: BranchState) {
        self.sampler = detached.sampler;
        self.grammar = detached.grammar;
        self.last_produced = detached.last_produced;
    }

    /// The adapter set its decodes run under.
    pub fn adapters(&self) -> &crate::adapter::Adapters {
        &self.adapters
    }

    pub fn grammar(&self) -> Option<&Grammar> {
        self.grammar.as_ref()
    }

    pub fn grammar_mut(&mut self) -> Option<&mut Grammar> {
        self.last_produced = None;
        self.grammar.as_mut()
    }

    /// Replace (or remove) the grammar.
    pub fn set_grammar(&mut self, grammar: Option<Grammar>) {
        self.last_produced = None;
        self.grammar = grammar;
    }

    /// Record `token` as chosen: penalty history and both perplexities.
    /// Perplexity uses the logits the token was chosen from, so accept
    /// before decoding.
    pub fn accept(&mut self, token: i32) -> Result<()> {
        let model_surprisal = self.model_surprisal(token, Base::Nats)?;
        if let Some(g) = self.grammar.as_mut() {
            if !g.allows(token)? {
                return Err(Error::Grammar(format!(
                    "token {token} is not allowed by the branch's grammar here"
                )));
            }
        }
        let sampling_prob = match self.last_produced {
            Some((t, p)) if t == token => p,
            _ => {
                let edited = self.sampling_logits()?.into_owned();
                self.sampler
                    .distribution(&edited)?
                    .into_iter()
                    .find(|&(t, _)| t == token)
                    .map_or(0.0, |(_, p)| p)
            }
        };
        self.perplexity.add(model_surprisal)?;
        self.sampling_perplexity.add(-sampling_prob.ln())?;
        if let Some(g) = self.grammar.as_mut() {
            g.consume_allowed(token)?; // `allows` approved it above
        }
        self.sampler.accept(token);
        self.last_produced = None;
        Ok(())
    }
}
