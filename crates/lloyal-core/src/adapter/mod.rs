//! LoRA adapters and control vectors.
//!
//! llama.cpp scopes them in two levels: an adapter is loaded into a *model*
//! (its tensors live as long as the model), and a *context* applies a set
//! of them -- adapters with scales, plus at most one control vector -- to
//! every decode until the set changes. lloyal gives each branch its own
//! set ([`Adapters`]), inherited by forks, and the worker groups the tokens
//! of a step by set: one decode per set in use, the set applied just before
//! it (`engine::adapters`), as llama-server does with per-request LoRA.
//! A context's default set (`Context::set_default_adapters`) is what new
//! branches start with and what the flat API and embeddings decode under.
//! This module holds the types and the file checks; applying a set and
//! loading on the worker are the engine's (`engine/adapters.rs`).
//!
//! Everything a file can get wrong is checked here before llama.cpp reads
//! it (`load`): llama.cpp's own checks would only say "failed" in its log.

pub(crate) mod load;

use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{invalid, Result};
use crate::model::Model;

/// A LoRA adapter loaded into a context's model. Cheap to clone; the
/// adapter's memory is freed with the model (llama.cpp's scope), so a
/// `Lora` keeps the model alive.
#[derive(Clone)]
pub struct Lora(Arc<LoraInner>);

struct LoraInner {
    raw: RawLora,
    model: Arc<Model>,
    path: PathBuf,
    alpha: f32,
    pairs: usize,
}

/// `llama_adapter_lora *`. llama.cpp never changes an adapter after it is
/// loaded; contexts only read it while they decode.
#[derive(Clone, Copy)]
pub(crate) struct RawLora(pub(crate) NonNull<llama_cpp_sys_2::llama_adapter_lora>);
// SAFETY: see the type's docs: shared read-only data, freed with the model.
unsafe impl Send for RawLora {}
// SAFETY: as above.
unsafe impl Sync for RawLora {}

impl Lora {
    /// Wrap an adapter llama.cpp loaded into `model` (see `load::init_lora`).
    pub(crate) fn new(
        raw: RawLora,
        model: Arc<Model>,
        path: PathBuf,
        alpha: f32,
        pairs: usize,
    ) -> Self {
        Lora(Arc::new(LoraInner {
            raw,
            model,
            path,
            alpha,
            pairs,
        }))
    }

    /// The `llama_adapter_lora *` (its identity: one per file and model).
    pub fn raw(&self) -> *mut llama_cpp_sys_2::llama_adapter_lora {
        self.0.raw.0.as_ptr()
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.0.path
    }

    /// `adapter.lora.alpha` from the file (0: none, the scale is used as is).
    pub fn alpha(&self) -> f32 {
        self.0.alpha
    }

    /// How many weight matrices it adapts (pairs of A and B tensors).
    pub fn n_pairs(&self) -> usize {
        self.0.pairs
    }

    /// The model it was loaded into.
    pub fn model(&self) -> &Arc<Model> {
        &self.0.model
    }
}

impl PartialEq for Lora {
    fn eq(&self, other: &Self) -> bool {
        self.0.raw.0 == other.0.raw.0
    }
}

impl std::fmt::Debug for Lora {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lora")
            .field("path", &self.0.path)
            .field("alpha", &self.0.alpha)
            .field("pairs", &self.0.pairs)
            .finish()
    }
}

/// A control vector: one direction per layer, added to that layer's output
/// (llama.cpp's `llama_set_adapter_cvec`), for the layers in `layers`.
/// Cheap to clone.
#[derive(Clone)]
pub struct ControlVector(Arc<CvInner>);

struct CvInner {
    /// Rows of `n_embd` values, for layers 1, 2, ... (llama.cpp has none
    /// for layer 0).
    data: Vec<f32>,
    n_embd: usize,
    /// First and last layer it applies to, inclusive.
    layers: (i32, i32),
    model: Arc<Model>,
}

impl ControlVector {
    /// A control vector from `directions`: `n_layer` rows of `n_embd`
    /// values (row-major, row `i` for layer `i`; row 0 must be zero, as
    /// llama.cpp applies none at layer 0), scaled by `scale`, applied to
    /// layers `layers` (inclusive; `None`: every layer from 1).
    pub fn new(
        model: &Arc<Model>,
        directions: &[f32],
        scale: f32,
        layers: Option<(i32, i32)>,
    ) -> Result<Self> {
        let n_embd = model.info().n_embd as usize;
        let n_layer = model.info().n_layer as usize;
        if n_embd == 0 || directions.len() != n_embd * n_layer {
            return Err(invalid(format!(
                "a control vector for this model has {n_layer} rows of {n_embd} values \
                 ({} in all), got {}",
                n_embd * n_layer,
                directions.len()
            )));
        }
        if directions[..n_embd].iter().any(|&v| v != 0.0) {
            return Err(invalid(
                "row 0 of a control vector must be zero: llama.cpp applies none at layer 0",
            ));
        }
        if !scale.is_finite() || directions.iter().any(|v| !v.is_finite()) {
            return Err(invalid("a control vector and its scale must be finite"));
        }
        let layers = check_layers(layers, n_layer)?;
        let data = directions[n_embd..].iter().map(|v| v * scale).collect();
        Ok(ControlVector(Arc::new(CvInner {
            data,
            n_embd,
            layers,
            model: Arc::clone(model),
        })))
    }

    /// Read a control vector file (GGUF, `direction.<layer>` tensors of
    /// `n_embd` f32 values, as llama.cpp's `cvector-generator` writes):
    /// see [`ControlVector::new`] for `scale` and `layers`.
    pub fn load(
        model: &Arc<Model>,
        path: impl AsRef<Path>,
        scale: f32,
        layers: Option<(i32, i32)>,
    ) -> Result<Self> {
        let directions = load::control_vector(model, path.as_ref())?;
        Self::new(model, &directions, scale, layers)
    }

    /// First and last layer it applies to, inclusive.
    pub fn layers(&self) -> (i32, i32) {
        self.0.layers
    }

    /// What `llama_set_adapter_cvec` takes: the rows from layer 1, and
    /// `n_embd`.
    pub(crate) fn data(&self) -> (&[f32], usize) {
        (&self.0.data, self.0.n_embd)
    }
}

impl PartialEq for ControlVector {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for ControlVector {}

impl std::hash::Hash for ControlVector {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        Arc::as_ptr(&self.0).hash(state);
    }
}

impl std::fmt::Debug for ControlVector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlVector")
            .field("layers", &self.0.layers)
            .finish()
    }
}

fn check_layers(layers: Option<(i32, i32)>, n_layer: usize) -> Result<(i32, i32)> {
    let last = i32::try_from(n_layer).unwrap_or(i32::MAX) - 1;
    let (start, end) = layers.unwrap_or((1, last));
    if start < 1 || end > last || start > end {
        return Err(invalid(format!(
            "control vector layers must satisfy 1 <= start <= end <= {last}, got ({start}, {end})"
        )));
    }
    Ok((start, end))
}

/// What a decode runs under: LoRA adapters with their scales, and at most
/// one control vector. The empty set is the base model.
#[derive(Clone, Debug, Default)]
pub struct Adapters {
    pub loras: Vec<(Lora, f32)>,
    pub control: Option<ControlVector>,
}

impl PartialEq for Adapters {
    fn eq(&self, other: &Self) -> bool {
        self.control == other.control
            && self.loras.len() == other.loras.len()
            && self
                .loras
                .iter()
                .zip(&other.loras)
                .all(|((a, x), (b, y))| a == b && x.to_bits() == y.to_bits())
    }
}

impl Adapters {
    pub fn is_empty(&self) -> bool {
        self.loras.is_empty() && self.control.is_none()
    }

    /// Refuse adapters of another model and scales that are not finite;
    /// drop the adapters at scale 0, which llama.cpp leaves out too (so a
    /// set equals the set without them).
    pub(crate) fn checked(mut self, model: &Arc<Model>) -> Result<Self> {
        self.check(model)?;
        self.loras.retain(|(_, scale)| *scale != 0.0);
        Ok(self)
    }

    fn check(&self, model: &Arc<Model>) -> Result<()> {
        for (lora, scale) in &self.loras {
            if !Arc::ptr_eq(lora.model(), model) {
                return Err(invalid(format!(
                    "the LoRA {} was loaded by another context; load it into this one",
                    lora.path().display()
                )));
            }
            if !scale.is_finite() {
                return Err(invalid(format!("a LoRA scale must be finite, got {scale}")));
            }
        }
        for (i, (a, _)) in self.loras.iter().enumerate() {
            if self.loras[..i].iter().any(|(b, _)| a == b) {
                return Err(invalid(format!(
                    "the LoRA {} is in the set twice",
                    a.path().display()
                )));
            }
        }
        match &self.control {
            Some(cv) if !Arc::ptr_eq(&cv.0.model, model) => Err(invalid(
                "the control vector was made for another context's model",
            )),
            _ => Ok(()),
        }
    }
}

/// `llama_context *`, read once when the worker starts (see
/// [`context_pointer`]): llama-cpp-2 0.1.160 applies one adapter at a time
/// and has no control-vector call, so sets go through llama.cpp's C API.
#[derive(Clone, Copy)]
pub(crate) struct RawContext(pub(crate) NonNull<llama_cpp_sys_2::llama_context>);
// SAFETY: only the thread holding the worker (which owns the context) uses it.
unsafe impl Send for RawContext {}

/// The `llama_context *` inside `ctx`. llama-cpp-2 0.1.160 keeps it private
/// and prints it in `Debug` (`LlamaContext { context: 0x... }`), the one
/// way to read it without relying on the struct's layout; `None` if that
/// output ever changes (sets other than the base model then fail with a
/// clear error, see `engine::adapters`). An upstreamable `LlamaContext::as_ptr`
/// would retire this.
pub(crate) fn context_pointer(ctx: &llama_cpp_2::context::LlamaContext<'_>) -> Option<RawContext> {
    let text = format!("{ctx:?}");
    let hex = text
        .strip_prefix("LlamaContext { context: 0x")?
        .strip_suffix(" }")?;
    let address = usize::from_str_radix(hex, 16).ok()?;
    let raw = NonNull::new(address as *mut llama_cpp_sys_2::llama_context)?;
    // SAFETY: the address is the context's own (printed from its field).
    let same = unsafe { llama_cpp_sys_2::llama_n_ctx(raw.as_ptr()) } == ctx.n_ctx();
    same.then_some(RawContext(raw))
}
