//! A projector file checked before libmtmd reads it: libmtmd *aborts* on a
//! metadata value of another type than the one it reads (`gguf_get_val_*`
//! asserts), so every key it reads as a scalar is checked for its type
//! first, with a message that says which key is wrong.

use std::path::Path;

use crate::error::{Error, Result};

const U32: u32 = 4;
const I32: u32 = 5;
const F32: u32 = 6;
const BOOL: u32 = 7;
const STR: u32 = 8;

fn refuse(path: &Path, reason: impl Into<String>) -> Error {
    Error::ProjectorLoad {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The GGUF type libmtmd reads `key` as, for the scalar keys it reads.
/// (Arrays it checks itself, with an error, not an abort.)
fn scalar_type(key: &str) -> Option<u32> {
    const BOOLS: &[&str] = &[
        "clip.has_vision_encoder",
        "clip.has_audio_encoder",
        "clip.has_gen_audio_encoder",
        "clip.use_gelu",
        "clip.use_silu",
    ];
    const STRS: &[&str] = &[
        "general.name",
        "general.description",
        "clip.gen.audio.model_variant",
        "clip.vision.mm_patch_merge_type",
    ];
    // Read per modality: clip.{vision,audio,gen.audio}.<suffix>.
    const U32_SUFFIXES: &[&str] = &[
        "embedding_length",
        "feed_forward_length",
        "block_count",
        "projection_dim",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.head_dim",
    ];
    if BOOLS.contains(&key) {
        return Some(BOOL);
    }
    if STRS.contains(&key) || key.ends_with("projector_type") {
        return Some(STR);
    }
    if key.ends_with(".attention.layer_norm_epsilon") || key == "clip.vision.swiglu_clamp" {
        return Some(F32);
    }
    if key == "clip.minicpmv_version" {
        return Some(I32);
    }
    let modality = ["clip.vision.", "clip.audio.", "clip.gen.audio."]
        .iter()
        .find_map(|p| key.strip_prefix(p));
    if modality.is_some_and(|rest| U32_SUFFIXES.contains(&rest)) {
        return Some(U32);
    }
    // The other integers libmtmd reads, all as u32.
    const U32_KEYS: &[&str] = &[
        "clip.vision.image_size",
        "clip.vision.patch_size",
        "clip.vision.image_min_pixels",
        "clip.vision.image_max_pixels",
        "clip.vision.preproc_min_tiles",
        "clip.vision.preproc_max_tiles",
        "clip.vision.preproc_image_size",
        "clip.vision.projector.scale_factor",
        "clip.vision.projector.query_side",
        "clip.vision.projector.window_side",
        "clip.vision.spatial_merge_size",
        "clip.vision.n_wa_pattern",
        "clip.vision.window_size",
        "clip.minicpmv_query_num",
        "clip.vision.sam.head_count",
        "clip.vision.sam.block_count",
        "clip.vision.sam.embedding_length",
        "clip.vision.expert_used_count",
        "clip.audio.num_mel_bins",
        "clip.audio.projector.stack_factor",
        "clip.audio.chunk_size",
        "clip.audio.conv_kernel_size",
        "clip.audio.max_pos_emb",
        "clip.audio.projector.window_size",
        "clip.audio.projector.downsample_rate",
        "clip.audio.projector.head_count",
        "clip.audio.rvq.num_quantizers",
        "clip.audio.window_size",
        "clip.audio.local_block_count",
        "clip.audio.local_group_size",
        "clip.audio.subsampling_factor",
    ];
    U32_KEYS.contains(&key).then_some(U32)
}

fn type_name(ty: u32) -> &'static str {
    match ty {
        U32 => "uint32",
        I32 => "int32",
        F32 => "float32",
        BOOL => "bool",
        STR => "string",
        _ => "another type",
    }
}

/// Check `path` as a projector (an mmproj GGUF): its architecture, the
/// type of every key libmtmd reads, and that plain float tensors fit in
/// the file. Whether it matches the text model (its output width) libmtmd
/// checks itself, with an error.
pub(crate) fn check_projector(path: &Path) -> Result<()> {
    let (_, t) = crate::adapter::load::open_gguf(path, refuse)?;
    let arch = t.header.string("general.architecture");
    if arch != Some("clip") {
        return Err(refuse(
            path,
            format!(
                "general.architecture is {:?}, not \"clip\": not a projector (mmproj) file",
                arch.unwrap_or("missing")
            ),
        ));
    }
    let mut keys: Vec<_> = t.header.types.iter().collect();
    keys.sort();
    for (key, &ty) in keys {
        if let Some(want) = scalar_type(key) {
            if ty != want {
                return Err(refuse(
                    path,
                    format!(
                        "{key} is {}, libmtmd reads it as {}",
                        type_name(ty),
                        type_name(want)
                    ),
                ));
            }
        }
    }
    for info in &t.tensors {
        if !t.fits_in_file(info) {
            return Err(refuse(
                path,
                format!(
                    "tensor {:?} ends past the end of the file (truncated?)",
                    info.name
                ),
            ));
        }
    }
    Ok(())
}
