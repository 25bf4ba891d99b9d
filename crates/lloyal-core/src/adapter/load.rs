//! Reading adapter files: every check llama.cpp makes, made first with a
//! message that says what is wrong (llama.cpp's own would only reach its
//! log), then llama.cpp's loader.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gguf::{self, TensorInfo, Tensors};
use crate::model::Model;
use crate::sync::lock;

const F32: u32 = 0;

fn refuse(path: &Path, reason: impl Into<String>) -> Error {
    Error::AdapterLoad {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn open(path: &Path) -> Result<(std::fs::File, Tensors)> {
    open_gguf(path, refuse)
}

/// Open a GGUF file beside the model (an adapter, a projector) and read
/// its tensor list; `refuse` makes the error for a file that is not one.
pub(crate) fn open_gguf(
    path: &Path,
    refuse: impl Fn(&Path, String) -> Error,
) -> Result<(std::fs::File, Tensors)> {
    if path.is_dir() {
        return Err(refuse(
            path,
            "the path is a directory, not a GGUF file".into(),
        ));
    }
    if !path.is_file() {
        return Err(Error::AdapterNotFound(path.to_path_buf()));
    }
    let file =
        std::fs::File::open(path).map_err(|e| refuse(path, format!("cannot open it: {e}")))?;
    let tensors = gguf::read_tensors(&file).map_err(|e| refuse(path, e.0))?;
    Ok((file, tensors))
}

/// Refuse a tensor whose data would end past the end of the file.
fn in_bounds(t: &Tensors, info: &TensorInfo, path: &Path) -> Result<()> {
    if t.fits_in_file(info) {
        Ok(())
    } else {
        Err(refuse(
            path,
            format!(
                "tensor {:?} ends past the end of the file (truncated?)",
                info.name
            ),
        ))
    }
}

/// Check a LoRA file against `model` (see `Context::load_lora`); returns
/// how many A/B pairs it has and its alpha.
pub(crate) fn check_lora(model: &Model, path: &Path) -> Result<(usize, f32)> {
    let (_, t) = open(path)?;
    let h = &t.header;
    for (key, want, what) in [
        ("general.type", "adapter", ": this is not an adapter file"),
        ("adapter.type", "lora", ""),
    ] {
        let found = h.string(key);
        if found != Some(want) {
            return Err(refuse(
                path,
                format!("{key} is {found:?}, not {want:?}{what}"),
            ));
        }
    }
    let arch = &model.info().architecture;
    if h.string("general.architecture") != Some(arch.as_str()) {
        return Err(refuse(
            path,
            format!(
                "it adapts a {:?} model, this model is {arch:?}",
                h.string("general.architecture").unwrap_or("unknown")
            ),
        ));
    }
    // llama.cpp reads the alpha with gguf_get_val_f32, which aborts the
    // process on any other type.
    let alpha = match (
        h.kv.get("adapter.lora.alpha"),
        h.types.get("adapter.lora.alpha"),
    ) {
        (None, _) => 0.0,
        (Some(gguf::Value::Float(a)), Some(6)) => *a as f32,
        _ => return Err(refuse(path, "adapter.lora.alpha must be a float32")),
    };
    let mut pairs: HashMap<&str, [Option<&TensorInfo>; 2]> = HashMap::new();
    for info in &t.tensors {
        in_bounds(&t, info, path)?;
        if let Some(base) = info.name.strip_suffix(".lora_a") {
            pairs.entry(base).or_default()[0] = Some(info);
        } else if let Some(base) = info.name.strip_suffix(".lora_b") {
            pairs.entry(base).or_default()[1] = Some(info);
        } else if !info.name.ends_with("_norm.weight") {
            return Err(refuse(
                path,
                format!("tensor {:?} is neither a .lora_a nor a .lora_b", info.name),
            ));
        }
    }
    if pairs.is_empty() {
        return Err(refuse(path, "it holds no LoRA tensors"));
    }
    // The base model's tensor shapes, read from its file; when it cannot be
    // read any more, or is the first of a split model (the others hold more
    // tensors), llama.cpp's loader checks the shapes alone.
    let base = std::fs::File::open(&model.info().path)
        .ok()
        .and_then(|f| gguf::read_tensors(f).ok())
        .filter(|b| b.header.int("split.count").is_none_or(|n| n <= 1))
        .map(|b| {
            b.tensors
                .into_iter()
                .map(|i| (i.name, i.ne))
                .collect::<HashMap<String, Vec<u64>>>()
        });
    // A model without output.weight multiplies by token_embd to get its
    // logits, and llama.cpp then applies a token_embd LoRA there too with
    // its embedding layout: ggml_mul_mat asserts and the process aborts.
    if pairs.keys().any(|n| n.starts_with("token_embd")) {
        let untied = base
            .as_ref()
            .is_some_and(|b| b.contains_key("output.weight"));
        if !untied {
            return Err(refuse(
                path,
                "it adapts token_embd, which this model also uses as its output layer \
                 (llama.cpp cannot apply such an adapter)",
            ));
        }
    }
    for (name, [a, b]) in &pairs {
        let (Some(a), Some(b)) = (a, b) else {
            return Err(refuse(
                path,
                format!("tensor {name:?} has only one of lora_a / lora_b"),
            ));
        };
        let dim = |i: &TensorInfo, k: usize| i.ne.get(k).copied().unwrap_or(1);
        // token_embd's pair is stored the other way round ([rank, n_vocab]
        // and [rank, n_embd]: llama.cpp gathers rows of A).
        let embd = name.starts_with("token_embd");
        let ranks_differ = if embd {
            dim(a, 0) != dim(b, 0)
        } else {
            dim(a, 1) != dim(b, 0)
        };
        if ranks_differ {
            return Err(refuse(
                path,
                format!("the ranks of {name:?}'s lora_a and lora_b differ (is lora_a transposed?)"),
            ));
        }
        let Some(base) = &base else { continue };
        let Some(ne) = base.get(*name) else {
            return Err(refuse(
                path,
                format!("the model has no tensor {name:?}: is this adapter for another model?"),
            ));
        };
        let ne = |k: usize| ne.get(k).copied().unwrap_or(1);
        let fits = if embd {
            ne(0) == dim(b, 1) && ne(1) == dim(a, 1)
        } else {
            ne(0) == dim(a, 0) && ne(1) == dim(b, 1)
        };
        if !fits {
            return Err(refuse(
                path,
                format!(
                    "the shapes of {name:?} do not match the model's {:?}: is this adapter for another model?",
                    [ne(0), ne(1)]
                ),
            ));
        }
    }
    Ok((pairs.len(), alpha))
}

/// Load a checked LoRA file into `model` with llama.cpp, once per file.
pub(crate) fn init_lora(
    model: &Arc<Model>,
    path: &Path,
) -> Result<NonNull<llama_cpp_sys_2::llama_adapter_lora>> {
    let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let mut loaded = lock(&model.loras);
    if let Some(&address) = loaded.get(&key) {
        return NonNull::new(address as *mut _).ok_or_else(|| Error::Internal("null LoRA".into()));
    }
    let utf8 = path
        .to_str()
        .ok_or_else(|| refuse(path, "the path is not valid UTF-8, which llama.cpp needs"))?;
    let c_path = std::ffi::CString::new(utf8).map_err(|e| refuse(path, e.to_string()))?;
    // SAFETY: the model pointer is valid while `model` lives, and the
    // worker (the caller) is the only thread using the model's adapter
    // list; `c_path` outlives the call.
    let raw = unsafe { llama_cpp_sys_2::llama_adapter_lora_init(model.raw(), c_path.as_ptr()) };
    let raw = NonNull::new(raw).ok_or_else(|| {
        refuse(
            path,
            "llama.cpp refused it after lloyal's checks passed (run with LLOYAL_LOG=1 to see why)",
        )
    })?;
    loaded.insert(key, raw.as_ptr() as usize);
    Ok(raw)
}

/// The directions of a control vector file: `n_layer` rows of `n_embd`
/// values, row 0 zero (see `ControlVector::new`).
pub(crate) fn control_vector(model: &Model, path: &Path) -> Result<Vec<f32>> {
    let (mut file, t) = open(path)?;
    let arch = t.header.string("general.architecture");
    if arch != Some("controlvector") {
        return Err(refuse(
            path,
            format!("general.architecture is {arch:?}, not \"controlvector\""),
        ));
    }
    let model_arch = &model.info().architecture;
    if let Some(hint) = t.header.string("controlvector.model_hint") {
        if hint != model_arch {
            return Err(refuse(
                path,
                format!("it was made for a {hint:?} model, this model is {model_arch:?}"),
            ));
        }
    }
    let n_embd = model.info().n_embd as usize;
    let n_layer = model.info().n_layer as usize;
    let mut data = vec![0f32; n_embd * n_layer];
    let mut found = 0;
    for info in &t.tensors {
        let layer = info
            .name
            .strip_prefix("direction.")
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&l| (1..n_layer).contains(&l))
            .ok_or_else(|| {
                refuse(
                    path,
                    format!(
                        "tensor {:?} is not direction.<layer> for a layer from 1 to {}",
                        info.name,
                        n_layer - 1
                    ),
                )
            })?;
        if info.ty != F32 || info.ne.iter().product::<u64>() != n_embd as u64 {
            return Err(refuse(
                path,
                format!("tensor {:?} must hold {n_embd} f32 values", info.name),
            ));
        }
        in_bounds(&t, info, path)?;
        let mut bytes = vec![0u8; n_embd * 4];
        file.seek(SeekFrom::Start(t.data_start + info.offset))
            .and_then(|_| file.read_exact(&mut bytes))
            .map_err(|e| refuse(path, format!("cannot read {:?}: {e}", info.name)))?;
        for (v, b) in data[layer * n_embd..(layer + 1) * n_embd]
            .iter_mut()
            .zip(bytes.chunks_exact(4))
        {
            *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        found += 1;
    }
    if found == 0 {
        return Err(refuse(path, "it holds no direction tensors"));
    }
    Ok(data)
}
