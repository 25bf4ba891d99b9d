//! KV persistence: a sequence's cache as bytes, framed so that only intact
//! data made for this model and KV layout ever reaches llama.cpp.
//!
//! llama.cpp's state reader trusts its input; feeding it arbitrary bytes is
//! unsound (llama-cpp-2 only offers it as `unsafe`). So a saved state is
//! wrapped in a frame -- magic, version, a fingerprint of the model and KV
//! types, the tokens it holds, and a CRC32 -- and loading checks all of it
//! before the payload is handed over. Corrupt, truncated or foreign data
//! becomes [`Error::State`]; the context is untouched.

use llama_cpp_2::context::session::LlamaStateSeqFlags;
use llama_cpp_2::context::LlamaContext;

use crate::error::{Error, Result};
use crate::model::Model;
use crate::params::ContextParams;

const MAGIC: &[u8; 8] = b"LLOYALKV";
const VERSION: u32 = 1;
const HEADER: usize = 8 + 4 + 8 + 4;

fn state_error(msg: impl Into<String>) -> Error {
    Error::State(msg.into())
}

/// What must match between the context that saved and the one that loads.
pub(crate) fn fingerprint(model: &Model, params: &ContextParams) -> u64 {
    let info = model.info();
    let mut h = crc32fast::Hasher::new();
    h.update(info.architecture.as_bytes());
    for n in [
        u64::from(info.vocab_size),
        u64::from(info.n_embd),
        u64::from(info.n_layer),
        info.n_params,
        info.size_bytes,
    ] {
        h.update(&n.to_le_bytes());
    }
    h.update(format!("{:?}/{:?}", params.type_k, params.type_v).as_bytes());
    let low = u64::from(h.finalize());
    (low << 32) | u64::from(crc32fast::hash(info.name.as_bytes()))
}

/// Frame `payload` (llama.cpp's bytes for one sequence) with its tokens.
pub(crate) fn encode(fingerprint: u64, tokens: &[i32], payload: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(8 + tokens.len() * 4 + payload.len());
    body.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
    for t in tokens {
        body.extend_from_slice(&t.to_le_bytes());
    }
    body.extend_from_slice(payload);
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&fingerprint.to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

/// Check a frame and split it into (tokens, payload).
pub(crate) fn decode(fingerprint: u64, data: &[u8]) -> Result<(Vec<i32>, &[u8])> {
    if data.len() < HEADER + 8 || &data[..8] != MAGIC {
        return Err(state_error(
            "not a lloyal KV state (bad magic or too short)",
        ));
    }
    let u32_at = |at: usize| u32::from_le_bytes(data[at..at + 4].try_into().unwrap_or([0; 4]));
    let u64_at = |at: usize| u64::from_le_bytes(data[at..at + 8].try_into().unwrap_or([0; 8]));
    if u32_at(8) != VERSION {
        return Err(state_error(format!(
            "KV state version {} is not supported (expected {VERSION})",
            u32_at(8)
        )));
    }
    if u64_at(12) != fingerprint {
        return Err(state_error(
            "the KV state was saved by a different model or KV cache type",
        ));
    }
    let body = &data[HEADER..];
    if crc32fast::hash(body) != u32_at(20) {
        return Err(state_error(
            "the KV state is corrupt or truncated (checksum mismatch)",
        ));
    }
    let n = usize::try_from(u64_at(HEADER)).map_err(|_| state_error("bad token count"))?;
    let tokens_end = 8usize
        .checked_add(
            n.checked_mul(4)
                .ok_or_else(|| state_error("bad token count"))?,
        )
        .filter(|&end| end <= body.len())
        .ok_or_else(|| state_error("the KV state is truncated"))?;
    let tokens = body[8..tokens_end]
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((tokens, &body[tokens_end..]))
}

/// llama.cpp's bytes for sequence `seq`.
pub(crate) fn read_seq(ctx: &LlamaContext<'_>, seq: i32) -> Result<Vec<u8>> {
    let flags = LlamaStateSeqFlags::empty();
    let size = ctx.state_seq_get_size_ext(seq, flags);
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` holds exactly the `size` bytes llama.cpp just said the
    // sequence needs, and nothing touches the context in between (the
    // worker thread owns it).
    let written = unsafe { ctx.state_seq_get_data_ext(buf.as_mut_ptr(), seq, flags) };
    if written != size {
        return Err(Error::Internal(format!(
            "llama.cpp wrote {written} of {size} state bytes"
        )));
    }
    Ok(buf)
}

/// Restore sequence `seq` from a payload that passed [`decode`].
pub(crate) fn write_seq(ctx: &mut LlamaContext<'_>, seq: i32, payload: &[u8]) -> Result<()> {
    // SAFETY: `payload` passed `decode`: its checksum matches and it was
    // produced by `read_seq` on a context with the same model and KV types,
    // so it is llama.cpp's own serialisation, which its reader accepts (and
    // still validates: cell counts, layer shapes, types).
    let ok = unsafe { ctx.state_seq_set_data_ext(payload, seq, LlamaStateSeqFlags::empty()) };
    if ok {
        Ok(())
    } else {
        Err(state_error(
            "llama.cpp rejected the KV state (does it fit in this context's n_ctx?)",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trips_and_rejects_damage() {
        let data = encode(42, &[1, 2, 3], b"payload");
        let (tokens, payload) = decode(42, &data).unwrap();
        assert_eq!(tokens, vec![1, 2, 3]);
        assert_eq!(payload, b"payload");
        assert!(matches!(decode(43, &data), Err(Error::State(_))));
        assert!(matches!(
            decode(42, &data[..data.len() - 1]),
            Err(Error::State(_))
        ));
        let mut flipped = data.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(matches!(decode(42, &flipped), Err(Error::State(_))));
        assert!(matches!(decode(42, b"garbage"), Err(Error::State(_))));
    }
}
