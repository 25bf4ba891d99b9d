//! A branch saved to bytes and restored.

use std::sync::Arc;

use crate::engine::Worker;
use crate::error::{Error, Result};
use crate::sampling::SamplingParams;
use crate::state::{BranchId, BranchState};
use crate::sync::lock;

/// Branch snapshot payload: `[u64 n_logits][f32 logits...][llama bytes]`.
pub(super) fn pack_branch(logits: Option<&[f32]>, llama: &[u8]) -> Vec<u8> {
    let logits = logits.unwrap_or(&[]);
    let mut out = Vec::with_capacity(8 + logits.len() * 4 + llama.len());
    out.extend_from_slice(&(logits.len() as u64).to_le_bytes());
    for l in logits {
        out.extend_from_slice(&l.to_le_bytes());
    }
    out.extend_from_slice(llama);
    out
}

pub(super) fn unpack_branch(payload: &[u8], vocab: usize) -> Result<(Option<Vec<f32>>, &[u8])> {
    let bad = || Error::State("the branch snapshot is malformed".into());
    let n = payload
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(bad)?;
    if n != 0 && n != vocab {
        return Err(bad());
    }
    let end = 8 + n * 4;
    let body = payload.get(8..end).ok_or_else(bad)?;
    let logits = (n > 0).then(|| {
        body.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    });
    Ok((logits, &payload[end..]))
}

impl Worker<'_> {
    pub(super) fn save_branch(&mut self, id: BranchId) -> Result<Vec<u8>> {
        let (seq, logits) = {
            let branches = lock(&self.shared.branches);
            let b = branches.get(id)?;
            (b.seq, b.logits.clone())
        };
        let llama = crate::kv::read_seq(&self.ctx, seq)?;
        let fp = crate::kv::fingerprint(&self.model, &self.params);
        Ok(crate::kv::encode(
            fp,
            &[],
            &pack_branch(logits.as_deref(), &llama),
        ))
    }

    pub(super) fn restore_branch(
        &mut self,
        data: &[u8],
        params: SamplingParams,
    ) -> Result<BranchId> {
        let fp = crate::kv::fingerprint(&self.model, &self.params);
        let (_, payload) = crate::kv::decode(fp, data)?;
        let (logits, llama) = unpack_branch(payload, self.model.vocab_size() as usize)?;
        let mut state = BranchState::new(0, params)?;
        self.model.bind_sampler(state.sampler_mut());
        state.adapters = lock(&self.shared.default_adapters).clone();
        let llama = crate::kv::check_payload(llama, self.ctx.n_ctx())?;
        let seq = lock(&self.shared.branches).lease(|s| self.shared.holds_flat_data(s))?;
        if let Err(e) = crate::kv::write_seq(&mut self.ctx, seq, llama) {
            lock(&self.shared.branches).release(seq);
            self.refresh_seq(seq);
            return Err(e);
        }
        self.refresh_seq(seq);
        state.seq = seq;
        state.position = self.ctx.kv_cache_seq_pos_max(seq) + 1;
        if let Some(l) = logits {
            state.set_logits(Arc::from(l));
        }
        Ok(lock(&self.shared.branches).insert(state))
    }
}
