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

/// Check a frame and split it into (tokens, payload). The payload itself is
/// checked by [`check_payload`].
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

/// The largest position a restored cell may hold. Positions are `i32` in
/// llama.cpp and every later decode adds to them; a forged state at
/// 2^31 - 1 would leave a sequence nothing can continue. Same bound as
/// `n_ctx` (`params::MAX_N_CTX`).
pub(crate) const MAX_POS: i32 = 1 << 30;

/// Byte cursor over a payload; every read is bounds-checked.
struct Cursor<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64) -> Option<&'a [u8]> {
        let n = usize::try_from(n).ok()?;
        let end = self.at.checked_add(n).filter(|&e| e <= self.data.len())?;
        let out = &self.data[self.at..end];
        self.at = end;
        Some(out)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn i32(&mut self) -> Option<i32> {
        Some(i32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

/// The shape of llama.cpp's sequence state for one model: whether cells
/// carry an extension record (M-RoPE models), whether layers store V, how
/// many caches are written in a row (two for sliding-window models).
#[derive(Clone, Copy, Debug)]
struct Layout {
    ext_bytes: u64,
    has_v: bool,
}

/// Check llama.cpp's bytes for one sequence before they reach its reader
/// (which trusts them): counts and lengths against the payload, one sequence
/// per cell, no more cells than the context has, and every position in
/// `[0, MAX_POS)` and distinct. The layout (cell extension records, V
/// present or not, one or two caches) follows from the model; a payload
/// must parse exactly, to its last byte, under one of them.
pub(crate) fn check_payload(payload: &[u8], n_cells: u32) -> Result<Checked<'_>> {
    let mut first_error = None;
    for ext_bytes in [0, 12] {
        for has_v in [true, false] {
            let layout = Layout { ext_bytes, has_v };
            match check_caches(payload, n_cells, layout) {
                Ok(()) => return Ok(Checked(payload)),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
    }
    Err(state_error(first_error.unwrap_or_default()))
}

/// llama.cpp state bytes that passed [`check_payload`] (or that
/// [`read_seq`] just produced): the only bytes [`write_seq`] takes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Checked<'a>(&'a [u8]);

/// The magic llama.cpp writes before a sequence state (`io_magic`).
const LLAMA_IO_MAGIC: u32 = 0xaf14_3cd8;

fn check_caches(payload: &[u8], n_cells: u32, layout: Layout) -> std::result::Result<(), String> {
    let mut c = Cursor {
        data: payload,
        at: 0,
    };
    // llama.cpp's own prefix: its magic, then the id of the saving sequence.
    if c.u32() != Some(LLAMA_IO_MAGIC) || c.i32().is_none() {
        return Err("not a llama.cpp sequence state (bad magic)".to_owned());
    }
    // One cache, or a sliding-window model's two (base, then SWA).
    for _ in 0..2 {
        check_cache(&mut c, n_cells, layout)?;
        if c.at == payload.len() {
            return Ok(());
        }
    }
    Err(format!(
        "{} unexpected bytes after the KV state's payload",
        payload.len() - c.at
    ))
}

fn check_cache(
    c: &mut Cursor<'_>,
    n_cells: u32,
    layout: Layout,
) -> std::result::Result<(), String> {
    let short = || "the KV state's payload is truncated".to_owned();
    let n_stream = c.u32().ok_or_else(short)?;
    if n_stream != 1 {
        return Err(format!(
            "the KV state has {n_stream} streams; a unified KV cache has 1"
        ));
    }
    let cells = c.u32().ok_or_else(short)?;
    if cells == 0 {
        return Ok(());
    }
    if cells > n_cells {
        return Err(format!(
            "the KV state holds {cells} cells, more than this context's {n_cells}"
        ));
    }
    let mut positions = Vec::with_capacity(cells as usize);
    for _ in 0..cells {
        let pos = c.i32().ok_or_else(short)?;
        let n_seq = c.u32().ok_or_else(short)?;
        c.take(layout.ext_bytes).ok_or_else(short)?;
        let _seq = c.i32().ok_or_else(short)?;
        if n_seq != 1 {
            return Err(format!(
                "a cell of the KV state claims {n_seq} sequences (1 expected)"
            ));
        }
        if !(0..MAX_POS).contains(&pos) {
            return Err(format!(
                "the KV state holds position {pos}, outside [0, {MAX_POS})"
            ));
        }
        positions.push(pos);
    }
    positions.sort_unstable();
    if let Some(w) = positions.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("the KV state holds position {} twice", w[0]));
    }
    let v_trans = c.u32().ok_or_else(short)?;
    let n_layer = c.u32().ok_or_else(short)?;
    let _rot = (c.u32().ok_or_else(short)?, c.u32().ok_or_else(short)?);
    if v_trans > 1 || n_layer == 0 || u64::from(n_layer) > crate::gguf::MAX_LAYERS {
        return Err(format!(
            "the KV state's layer header is invalid (v_trans={v_trans}, n_layer={n_layer})"
        ));
    }
    let rows = |c: &mut Cursor<'_>| -> std::result::Result<(), String> {
        let _ty = c.i32().ok_or_else(short)?;
        let row = c.u64().ok_or_else(short)?;
        let bytes = row
            .checked_mul(u64::from(cells))
            .ok_or_else(|| "a row size in the KV state overflows".to_owned())?;
        c.take(bytes).ok_or_else(short).map(|_| ())
    };
    for _ in 0..n_layer {
        rows(c)?;
    }
    if layout.has_v {
        for _ in 0..n_layer {
            if v_trans == 0 {
                rows(c)?;
            } else {
                let _ty = c.i32().ok_or_else(short)?;
                let el = u64::from(c.u32().ok_or_else(short)?);
                let embd = u64::from(c.u32().ok_or_else(short)?);
                let bytes = el
                    .checked_mul(embd)
                    .and_then(|b| b.checked_mul(u64::from(cells)))
                    .ok_or_else(|| "a V size in the KV state overflows".to_owned())?;
                c.take(bytes).ok_or_else(short)?;
            }
        }
    }
    Ok(())
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

/// Replace sequence `seq` with checked state bytes (see [`Checked`]); on
/// failure the sequence is left empty.
pub(crate) fn write_seq(ctx: &mut LlamaContext<'_>, seq: i32, payload: Checked<'_>) -> Result<()> {
    let _ = ctx.kv_cache_seq_rm(seq, None, None);
    // SAFETY: the bytes passed `check_payload` (every count and length fits
    // them, positions are in range; callers also checked the frame: its
    // checksum matches and it was made for this model and KV types) or are
    // llama.cpp's own from `read_seq`, so llama.cpp's reader, which trusts
    // lengths, stays in bounds; it still validates layer shapes and types.
    let ok = unsafe { ctx.state_seq_set_data_ext(payload.0, seq, LlamaStateSeqFlags::empty()) };
    if ok {
        Ok(())
    } else {
        let _ = ctx.kv_cache_seq_rm(seq, None, None);
        Err(state_error(
            "llama.cpp rejected the KV state (does it fit in this context's n_ctx?)",
        ))
    }
}

/// [`write_seq`], putting the sequence's previous cells back when the state
/// is refused at any stage.
pub(crate) fn replace_seq(ctx: &mut LlamaContext<'_>, seq: i32, payload: &[u8]) -> Result<()> {
    let payload = check_payload(payload, ctx.n_ctx())?;
    let before = read_seq(ctx, seq)?;
    write_seq(ctx, seq, payload).inspect_err(|_| {
        // Our own bytes from a moment ago: llama.cpp's reader takes them back.
        let _ = write_seq(ctx, seq, Checked(&before));
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A payload in llama.cpp's layout: one cache, `positions.len()` cells,
    /// two layers with 4-byte K and V rows (not transposed).
    pub(crate) fn payload(positions: &[i32], caches: usize) -> Vec<u8> {
        let mut b = LLAMA_IO_MAGIC.to_le_bytes().to_vec();
        b.extend(0i32.to_le_bytes());
        for _ in 0..caches {
            b.extend(1u32.to_le_bytes());
            b.extend((positions.len() as u32).to_le_bytes());
            if positions.is_empty() {
                continue; // llama.cpp writes no data for an empty cache
            }
            for &p in positions {
                b.extend(p.to_le_bytes());
                b.extend(1u32.to_le_bytes());
                b.extend(0i32.to_le_bytes());
            }
            for x in [0u32, 2, 0, 0] {
                b.extend(x.to_le_bytes());
            }
            for _ in 0..4 {
                b.extend(1i32.to_le_bytes());
                b.extend(4u64.to_le_bytes());
                b.extend(vec![7u8; 4 * positions.len()]);
            }
        }
        b
    }

    #[test]
    fn payload_check_accepts_llama_cpp_layouts_and_refuses_forgeries() {
        check_payload(&payload(&[0, 1, 2], 1), 256).unwrap();
        check_payload(&payload(&[0, 1, 2], 2), 256).unwrap(); // SWA: two caches
        check_payload(&payload(&[], 1), 256).unwrap();
        let refused = |p: &[u8], needle: &str| match check_payload(p, 256) {
            Err(Error::State(m)) => assert!(m.contains(needle), "{m}"),
            other => panic!("{other:?}"),
        };
        refused(&payload(&[0, -5, 2], 1), "position -5");
        refused(&payload(&[0, i32::MAX - 1], 1), "outside");
        refused(&payload(&[3, 3], 1), "twice");
        refused(&payload(&[0, 1, 2], 3), "unexpected bytes");
        let many: Vec<i32> = (0..300).collect();
        refused(&payload(&many, 1), "more than this context's 256");
        // Every truncation is refused, but one: cut right after the K rows,
        // the bytes are a valid state of a model that stores no V (the
        // layout is not known here). llama.cpp's reader is bounded by the
        // buffer and refuses that for a model with V.
        let full = payload(&[0, 1, 2], 1);
        let k_end = 8 + 8 + 3 * 12 + 16 + 2 * (12 + 12);
        for n in 0..full.len() {
            assert_eq!(
                check_payload(&full[..n], 256).is_ok(),
                n == k_end,
                "prefix {n}"
            );
        }
    }

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
