//! Branch state, the arena that holds it, and the KV leases branches hold.
//!
//! A branch is plain data -- sampler (with its RNG), logits snapshot,
//! metrics, biases, position -- so forking is cloning. The arena hands out
//! generational handles: a handle to a pruned branch stays invalid even
//! after its slot is reused. KV sequence ids are leases: taken when a
//! branch is created or forked, given back (after the worker clears the
//! sequence's cells) when it is pruned. Users never see sequence ids.

use std::sync::Arc;

use crate::error::{invalid, Error, Result};
use crate::grammar::Grammar;
use crate::metrics::{self, Base, LogitStats, PerplexityTracker};
use crate::sampling::{Sampler, SamplingParams};

use super::view::LogitsView;

/// An opaque, generational branch handle that also names its context: a
/// handle used with another context's branches is refused, never mistaken
/// for one of theirs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BranchId {
    /// Slot index. Slots are reused, and every live branch holds one of at
    /// most `MAX_SEQUENCES` leases, so it fits 16 bits.
    index: u16,
    /// The [`Branches`] (one per context) that issued it.
    context: u16,
    generation: u32,
}

impl BranchId {
    /// Pack into one integer (for bindings).
    pub fn to_bits(self) -> u64 {
        (u64::from(self.generation) << 32) | (u64::from(self.context) << 16) | u64::from(self.index)
    }

    pub fn from_bits(bits: u64) -> Self {
        Self {
            index: bits as u16,
            context: (bits >> 16) as u16,
            generation: (bits >> 32) as u32,
        }
    }
}

/// Tags for [`Branches`]: distinct for the last 65,536 contexts created.
static NEXT_CONTEXT_TAG: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);

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
        }
    }

    /// Take back what [`BranchState::detach_for_produce`] took, as `produce`
    /// left it (the random stream advanced).
    pub(crate) fn reattach(&mut self, detached: BranchState) {
        self.sampler = detached.sampler;
        self.grammar = detached.grammar;
        self.last_produced = detached.last_produced;
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

struct Slot {
    generation: u32,
    state: Option<BranchState>,
}

/// Every branch of a context, plus the free KV sequence ids.
pub struct Branches {
    tag: u16,
    slots: Vec<Slot>,
    free_slots: Vec<u16>,
    free_seqs: Vec<i32>,
    n_seq_max: u32,
}

impl Branches {
    /// Sequence 0 is left to the flat API (`ctx.decode(..., seq_id=0)`)
    /// until a branch needs it; branches take the highest free ids first.
    pub fn new(n_seq_max: u32) -> Self {
        Self {
            tag: NEXT_CONTEXT_TAG.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            slots: Vec::new(),
            free_slots: Vec::new(),
            free_seqs: (0..n_seq_max as i32).collect(),
            n_seq_max,
        }
    }

    /// KV cells the live branches hold, counting a shared prefix once: a
    /// branch holds its cells from the point it still shares with its
    /// parent (its fork head, or the parent's position if that is lower)
    /// to its own position; a root, or a branch whose parent is gone, all
    /// of its own. An estimate after a truncate below a fork head followed
    /// by new tokens on both sides (each side is counted from the shared
    /// point); exact otherwise.
    pub fn cells_held(&self) -> u64 {
        let live = self.slots.iter().filter_map(|s| s.state.as_ref());
        live.map(|b| {
            let shared = b
                .parent
                .and_then(|p| self.get(p).ok())
                .map_or(0, |p| b.fork_head.min(p.position));
            u64::try_from(b.position - shared.min(b.position)).unwrap_or(0)
        })
        .sum()
    }

    /// Leases free now.
    pub fn available(&self) -> usize {
        self.free_seqs.len()
    }

    /// The sequence ids no branch holds.
    pub fn free_seqs(&self) -> impl Iterator<Item = i32> + '_ {
        self.free_seqs.iter().copied()
    }

    pub fn n_seq_max(&self) -> u32 {
        self.n_seq_max
    }

    /// Take a free sequence id, the highest first, skipping those for which
    /// `holds_flat_data` is true: a lease never takes (and wipes) cells the
    /// flat API decoded.
    pub(crate) fn lease(&mut self, holds_flat_data: impl Fn(i32) -> bool) -> Result<i32> {
        if let Some(at) = self.free_seqs.iter().rposition(|&s| !holds_flat_data(s)) {
            return Ok(self.free_seqs.remove(at));
        }
        if self.free_seqs.is_empty() {
            return Err(Error::NoLease(format!(
                "all {} KV leases (n_seq_max) are held by live branches; prune a branch \
                 (or retain_only a winner) to free one, or create the context with a larger n_seq_max",
                self.n_seq_max
            )));
        }
        Err(Error::NoLease(format!(
            "every KV sequence not held by a branch holds tokens the flat API decoded \
             (seq_id {:?}); a branch would wipe them. Remove them first \
             (ctx.kv_cache_remove(seq_id, 0)) or create the context with a larger n_seq_max",
            self.free_seqs
        )))
    }

    /// Give a lease back. Call only after its KV cells were cleared.
    pub(crate) fn release(&mut self, seq: i32) {
        debug_assert!(!self.free_seqs.contains(&seq));
        self.free_seqs.push(seq);
    }

    pub(crate) fn insert(&mut self, state: BranchState) -> BranchId {
        if let Some(index) = self.free_slots.pop() {
            let slot = &mut self.slots[index as usize];
            slot.state = Some(state);
            BranchId {
                index,
                context: self.tag,
                generation: slot.generation,
            }
        } else {
            let index = u16::try_from(self.slots.len())
                .expect("live branches are bounded by n_seq_max <= 256");
            self.slots.push(Slot {
                generation: 0,
                state: Some(state),
            });
            BranchId {
                index,
                context: self.tag,
                generation: 0,
            }
        }
    }

    /// Make `id`'s children roots (a branch freed without its subtree:
    /// the children keep their own cells).
    pub(crate) fn detach_children(&mut self, id: BranchId) {
        let children = self
            .get_mut(id)
            .map(|b| std::mem::take(&mut b.children))
            .unwrap_or_default();
        for child in children {
            if let Ok(c) = self.get_mut(child) {
                c.parent = None;
            }
        }
    }

    /// Remove a branch; its handle (and any copy of it) is stale from now on.
    pub(crate) fn remove(&mut self, id: BranchId) -> Result<BranchState> {
        self.get(id)?;
        let slot = &mut self.slots[id.index as usize];
        let state = slot.state.take().ok_or(Error::BranchDisposed)?;
        slot.generation = slot.generation.wrapping_add(1);
        self.free_slots.push(id.index);
        if let Some(parent) = state.parent {
            if let Ok(p) = self.get_mut(parent) {
                p.children.retain(|&c| c != id);
            }
        }
        Ok(state)
    }

    /// Refuse a handle issued by another context's `Branches`.
    fn own(&self, id: BranchId) -> Result<()> {
        if id.context == self.tag {
            Ok(())
        } else {
            Err(Error::InvalidArgument(
                "the branch belongs to another context".to_owned(),
            ))
        }
    }

    pub fn get(&self, id: BranchId) -> Result<&BranchState> {
        self.own(id)?;
        self.slots
            .get(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.state.as_ref())
            .ok_or(Error::BranchDisposed)
    }

    pub fn get_mut(&mut self, id: BranchId) -> Result<&mut BranchState> {
        self.own(id)?;
        self.slots
            .get_mut(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.state.as_mut())
            .ok_or(Error::BranchDisposed)
    }

    /// `id` and its descendants, children before parents.
    pub fn subtree_post_order(&self, id: BranchId) -> Result<Vec<BranchId>> {
        let mut order = Vec::new();
        let mut stack = vec![(id, false)];
        while let Some((node, expanded)) = stack.pop() {
            if expanded {
                order.push(node);
                continue;
            }
            stack.push((node, true));
            for &child in &self.get(node)?.children {
                stack.push((child, false));
            }
        }
        Ok(order)
    }

    /// Take every branch out (the context is closing): their handles are
    /// stale from now on and their states are returned to be dropped.
    pub(crate) fn take_all(&mut self) -> Vec<BranchState> {
        let mut states = Vec::new();
        for (index, slot) in self.slots.iter_mut().enumerate() {
            if let Some(state) = slot.state.take() {
                slot.generation = slot.generation.wrapping_add(1);
                self.free_slots.push(index as u16);
                self.free_seqs.push(state.seq);
                states.push(state);
            }
        }
        states
    }

    /// Every live branch.
    pub fn ids(&self) -> Vec<BranchId> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state.is_some())
            .map(|(i, s)| BranchId {
                index: i as u16,
                context: self.tag,
                generation: s.generation,
            })
            .collect()
    }

    /// Whether `seq` is leased by a branch.
    pub(crate) fn is_leased(&self, seq: i32) -> bool {
        !self.free_seqs.contains(&seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(b: &mut Branches) -> BranchState {
        let seq = b.lease(|_| false).unwrap();
        BranchState::new(seq, SamplingParams::greedy()).unwrap()
    }

    #[test]
    fn stale_handles_stay_stale_after_slot_reuse() {
        let mut b = Branches::new(4);
        let s = state(&mut b);
        let a = b.insert(s);
        let removed = b.remove(a).unwrap();
        b.release(removed.seq);
        let s = state(&mut b);
        let c = b.insert(s);
        assert_eq!(a.index, c.index);
        assert!(matches!(b.get(a), Err(Error::BranchDisposed)));
        assert!(b.get(c).is_ok());
        assert_eq!(BranchId::from_bits(c.to_bits()), c);
    }

    #[test]
    fn leases_run_out_and_come_back() {
        let mut b = Branches::new(2);
        let x = b.lease(|_| false).unwrap();
        let _y = b.lease(|_| false).unwrap();
        assert_eq!(b.available(), 0);
        let err = b.lease(|_| false).unwrap_err();
        assert!(err.to_string().contains("all 2 KV leases"), "{err}");
        b.release(x);
        assert_eq!(b.available(), 1);
    }

    #[test]
    fn subtree_is_post_order() {
        let mut b = Branches::new(8);
        let s = state(&mut b);
        let root = b.insert(s);
        let mut kids = Vec::new();
        for _ in 0..2 {
            let seq = b.lease(|_| false).unwrap();
            let child = b.get(root).unwrap().fork(seq, root);
            let id = b.insert(child);
            b.get_mut(root).unwrap().children.push(id);
            kids.push(id);
        }
        let order = b.subtree_post_order(root).unwrap();
        assert_eq!(order.len(), 3);
        assert_eq!(*order.last().unwrap(), root);
    }

    #[test]
    fn accept_tracks_both_perplexities() {
        let mut s = BranchState::new(0, SamplingParams::greedy()).unwrap();
        s.set_logits(Arc::from(vec![0.0f32, 1.0, 2.0]));
        let t = s.produce().unwrap();
        assert_eq!(t, 2);
        s.accept(t).unwrap();
        // Greedy: the sampling distribution is a point mass.
        assert!((s.sampling_perplexity.perplexity() - 1.0).abs() < 1e-12);
        assert!(s.perplexity.perplexity() > 1.0);
        // A forced token outside the greedy support has infinite surprisal.
        s.accept(0).unwrap();
        assert!(s.sampling_perplexity.perplexity().is_infinite());
    }
}
