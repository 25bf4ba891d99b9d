//! The arena that holds every branch of a context, and the KV leases.
//!
//! The arena hands out generational handles: a handle to a pruned branch
//! stays invalid even after its slot is reused. KV sequence ids are
//! leases: taken when a branch is created or forked, given back (after the
//! worker clears the sequence's cells) when it is pruned. Users never see
//! sequence ids.

use crate::error::{Error, Result};

use super::branch::BranchState;
use super::id::BranchId;

/// Tags for [`Branches`]: distinct for the last 65,536 contexts created.
static NEXT_CONTEXT_TAG: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);

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

    /// Mark these branches idle again: the operation that marked them busy
    /// has finished. Branches pruned meanwhile are skipped.
    pub(crate) fn clear_busy(&mut self, ids: impl IntoIterator<Item = BranchId>) {
        for id in ids {
            if let Ok(b) = self.get_mut(id) {
                b.busy = false;
            }
        }
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
    use std::sync::Arc;

    use crate::sampling::SamplingParams;

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
