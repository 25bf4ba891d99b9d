//! A loaded GGUF model: weights plus the vocabulary facts every other module
//! needs (vocab size, stop tokens, BOS flag, chat template). A `Model` is
//! shared (`Arc`) between the worker that decodes and the threads that
//! tokenize, which llama.cpp allows: the model is read-only after load.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

use crate::backend::backend;
use crate::error::{invalid, Error, Result};
use crate::gguf;
use crate::params::KvType;
use crate::sampling::Sampler;
use crate::sync::lock;

/// Facts about a model, read once at load time.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelInfo {
    pub path: PathBuf,
    pub name: String,
    pub architecture: String,
    pub n_params: u64,
    pub size_bytes: u64,
    pub n_ctx_train: u32,
    pub n_embd: u32,
    pub n_layer: u32,
    pub vocab_size: u32,
    pub has_chat_template: bool,
}

/// The vocabulary's fill-in-the-middle tokens (llama.cpp reads them from
/// the GGUF's `tokenizer.ggml.fim_*_token_id` keys, or finds them by their
/// text); `None` where the model has none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FimTokens {
    /// Before the code ahead of the cursor.
    pub prefix: Option<i32>,
    /// Before the code after the cursor.
    pub suffix: Option<i32>,
    /// Where the model writes the middle.
    pub middle: Option<i32>,
    pub pad: Option<i32>,
    /// Before a repository's name (extra context).
    pub repo: Option<i32>,
    /// Before each extra file.
    pub file_sep: Option<i32>,
}

impl FimTokens {
    /// Whether the model can fill in the middle: it has the prefix, suffix
    /// and middle tokens.
    pub fn complete(&self) -> bool {
        self.prefix.is_some() && self.suffix.is_some() && self.middle.is_some()
    }
}

/// A loaded model. Cheap to share; see the module docs.
pub struct Model {
    pub(crate) llama: LlamaModel,
    info: ModelInfo,
    chat_template: Option<String>,
    is_eog: Vec<bool>,
    eog_token: i32,
    bos_token: Option<i32>,
    add_bos: bool,
    fim: FimTokens,
    /// Data other modules derive from the model once and keep with it
    /// (the grammar module's token trie), by type: see [`Model::cached`].
    derived: std::sync::Mutex<HashMap<std::any::TypeId, Arc<dyn std::any::Any + Send + Sync>>>,
    /// DRY breaker token sets, by breaker strings.
    dry_breakers: std::sync::Mutex<HashMap<Vec<String>, Arc<HashSet<i32>>>>,
    /// LoRA adapters loaded into this model (`llama_adapter_lora *` as an
    /// address), by canonical path: each file is loaded once.
    pub(crate) loras: std::sync::Mutex<HashMap<PathBuf, usize>>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("info", &self.info).finish()
    }
}

/// `llama_model_load_from_file` with `use_extra_bufts = false` (no
/// repacked weights), which llama-cpp-2 0.1.160 has no setter for: the
/// parameters are llama.cpp's defaults, as `LlamaModelParams::default()`
/// gives them, plus the GPU layer count. (An upstreamable one-line setter,
/// `LlamaModelParams::with_use_extra_bufts`, would retire this.)
fn load_without_repack(path: &Path, n_gpu_layers: u32) -> std::result::Result<LlamaModel, String> {
    use std::ptr::NonNull;
    // `LlamaModel` is one field, a `#[repr(transparent)]` wrapper of
    // `NonNull<llama_model>`; its `Drop` frees the model.
    const _: () = assert!(
        std::mem::size_of::<LlamaModel>()
            == std::mem::size_of::<NonNull<llama_cpp_sys_2::llama_model>>()
            && std::mem::align_of::<LlamaModel>()
                == std::mem::align_of::<NonNull<llama_cpp_sys_2::llama_model>>()
    );
    let utf8 = path.to_str().ok_or("the path is not valid UTF-8")?;
    let c_path = std::ffi::CString::new(utf8).map_err(|e| e.to_string())?;
    // SAFETY: plain C calls; the parameters are a by-value struct whose
    // pointers are llama.cpp's defaults (null), and `c_path` outlives the call.
    let raw = unsafe {
        let mut params = llama_cpp_sys_2::llama_model_default_params();
        params.n_gpu_layers = i32::try_from(n_gpu_layers).unwrap_or(i32::MAX);
        params.use_extra_bufts = false;
        llama_cpp_sys_2::llama_model_load_from_file(c_path.as_ptr(), params)
    };
    let raw = NonNull::new(raw).ok_or("llama.cpp returned no model")?;
    // SAFETY: same size and alignment (checked above), and `LlamaModel`
    // holds nothing but this pointer, which it owns from here on.
    Ok(unsafe { std::mem::transmute::<NonNull<llama_cpp_sys_2::llama_model>, LlamaModel>(raw) })
}

impl Model {
    /// Load a GGUF file. `n_gpu_layers < 0` offloads every layer that the
    /// build can offload (none on a CPU-only build). `repack: false` keeps
    /// the weights in their file layout: llama.cpp's CPU backend otherwise
    /// repacks some types (Q4_0, Q4_K, IQ4_NL on x86) for a GEMM kernel
    /// whose results depend on a token's row in the batch (the
    /// deterministic mode needs it off).
    pub fn load(path: impl AsRef<Path>, n_gpu_layers: i32, repack: bool) -> Result<Arc<Model>> {
        let path = path.as_ref().to_path_buf();
        let file = check_gguf_file(&path)?;
        let backend = backend()?;
        let layers = u32::try_from(n_gpu_layers).unwrap_or(u32::MAX >> 1);
        let params = LlamaModelParams::default().with_n_gpu_layers(layers);
        // llama.cpp takes a C string: a path that is not UTF-8 is handed over
        // as the descriptor of the file we already opened (Linux).
        let load_path = if path.to_str().is_some() {
            path.clone()
        } else {
            fd_path(&file).ok_or_else(|| Error::ModelLoad {
                path: path.clone(),
                reason: "the path is not valid UTF-8, which llama.cpp needs on this platform"
                    .to_owned(),
            })?
        };
        let loaded = if repack {
            LlamaModel::load_from_file(backend, &load_path, &params).map_err(|e| e.to_string())
        } else {
            load_without_repack(&load_path, layers)
        };
        drop(file);
        let llama = loaded.map_err(|e| Error::ModelLoad {
                path: path.clone(),
                reason: format!(
                    "llama.cpp rejected the file ({e}); it may be truncated or use an unsupported architecture"
                ),
            })?;
        Ok(Arc::new(Self::from_llama(llama, path)))
    }

    fn from_llama(llama: LlamaModel, path: PathBuf) -> Self {
        let vocab = llama.vocab();
        let vocab_size = u32::try_from(vocab.n_tokens()).unwrap_or(0);
        let is_eog: Vec<bool> = (0..vocab.n_tokens())
            .map(|t| vocab.is_eog(LlamaToken(t)))
            .collect();
        let eot = vocab.eot().0;
        let eos = vocab.eos().0;
        let in_vocab = |t: i32| t >= 0 && (t as u32) < vocab_size;
        let eog_token = if in_vocab(eot) && is_eog[eot as usize] {
            eot
        } else if in_vocab(eos) {
            eos
        } else {
            is_eog.iter().position(|&e| e).map_or(-1, |i| i as i32)
        };
        let bos = vocab.bos().0;
        let bos_token = in_vocab(bos).then_some(bos);
        let add_bos = vocab.should_add_bos();
        let known = |t: LlamaToken| in_vocab(t.0).then_some(t.0);
        let fim = FimTokens {
            prefix: known(vocab.fim_pre()),
            suffix: known(vocab.fim_suf()),
            middle: known(vocab.fim_mid()),
            pad: known(vocab.fim_pad()),
            repo: known(vocab.fim_rep()),
            file_sep: known(vocab.fim_sep()),
        };
        let chat_template = llama
            .chat_template(None)
            .ok()
            .and_then(|t| t.to_string().ok())
            .filter(|t| !t.trim().is_empty());
        let meta = |key: &str| llama.meta_val_str(key).unwrap_or_default();
        let architecture = meta("general.architecture");
        let name = meta("general.name");
        let info = ModelInfo {
            path,
            name,
            architecture,
            n_params: llama.n_params(),
            size_bytes: llama.size(),
            n_ctx_train: llama.n_ctx_train(),
            n_embd: u32::try_from(llama.n_embd()).unwrap_or(0),
            n_layer: llama.n_layer(),
            vocab_size,
            has_chat_template: chat_template.is_some(),
        };
        Model {
            llama,
            info,
            chat_template,
            is_eog,
            eog_token,
            bos_token,
            add_bos,
            fim,
            derived: Default::default(),
            dry_breakers: Default::default(),
            loras: Default::default(),
        }
    }

    /// The `llama_model *` (for C calls llama-cpp-2 does not wrap).
    pub(crate) fn raw(&self) -> *mut llama_cpp_sys_2::llama_model {
        // SAFETY: `LlamaModel` is a `#[repr(transparent)]` `NonNull` (checked
        // in `load_without_repack`); copying the pointer out takes nothing.
        unsafe {
            std::mem::transmute_copy::<LlamaModel, std::ptr::NonNull<llama_cpp_sys_2::llama_model>>(
                &self.llama,
            )
        }
        .as_ptr()
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// The `T` derived from this model by `make`, computed on first use and
    /// kept as long as the model (a failure is kept too: `make` runs once).
    /// It lets a module cache per-model data without the model knowing it.
    pub(crate) fn cached<T: Send + Sync + 'static>(&self, make: impl FnOnce(&Self) -> T) -> Arc<T> {
        let key = std::any::TypeId::of::<T>();
        if let Some(found) = lock(&self.derived).get(&key) {
            return Arc::clone(found)
                .downcast::<T>()
                .expect("keyed by its type");
        }
        // Built without the lock (it may take a while); a racing builder's
        // value is dropped in favour of the first one stored.
        let made: Arc<dyn std::any::Any + Send + Sync> = Arc::new(make(self));
        let stored = Arc::clone(lock(&self.derived).entry(key).or_insert(made));
        stored.downcast::<T>().expect("keyed by its type")
    }

    pub fn vocab_size(&self) -> u32 {
        self.info.vocab_size
    }

    /// The Jinja chat template stored in the GGUF, if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The token that ends generation (EOT where the model has one, else EOS).
    pub fn eog_token(&self) -> i32 {
        self.eog_token
    }

    pub fn bos_token(&self) -> Option<i32> {
        self.bos_token
    }

    /// The fill-in-the-middle tokens.
    pub fn fim_tokens(&self) -> FimTokens {
        self.fim
    }

    /// Whether the GGUF declares a reranker (rank pooling, a
    /// classification head): what `pooling = rank` needs.
    pub fn is_reranker(&self) -> bool {
        self.meta(&format!("{}.pooling_type", self.info.architecture))
            .is_some_and(|p| p.trim() == "4")
    }

    /// The outputs of a reranker's classification head (what rank pooling
    /// gives per input).
    pub fn n_cls_out(&self) -> u32 {
        // SAFETY: `raw` is the live model this value owns; the call reads
        // a hyperparameter.
        unsafe { llama_cpp_sys_2::llama_model_n_cls_out(self.raw()) }
    }

    /// Whether tokenizing with `add_special` prepends BOS for this model.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `token` ends generation (any end-of-generation token).
    pub fn is_stop_token(&self, token: i32) -> Result<bool> {
        self.check_token(token)?;
        Ok(self.is_eog[token as usize])
    }

    /// A GGUF metadata value as a string, if the key exists.
    pub fn meta(&self, key: &str) -> Option<String> {
        self.llama.meta_val_str(key).ok()
    }

    /// Fail with `InvalidArgument` unless `token` is in `[0, vocab_size)`.
    /// Every entry point that hands a token to llama.cpp calls this first:
    /// llama.cpp indexes its tables unchecked (or throws across the FFI).
    pub fn check_token(&self, token: i32) -> Result<()> {
        if token < 0 || token as u32 >= self.info.vocab_size {
            return Err(invalid(format!(
                "token id {token} is out of range [0, {})",
                self.info.vocab_size
            )));
        }
        Ok(())
    }

    pub fn check_tokens(&self, tokens: &[i32]) -> Result<()> {
        tokens.iter().try_for_each(|&t| self.check_token(t))
    }

    /// Tokenize `text`. `add_special = None` follows the model's BOS flag.
    pub fn tokenize(
        &self,
        text: &str,
        add_special: Option<bool>,
        parse_special: bool,
    ) -> Result<Vec<i32>> {
        if text.len() > (i32::MAX / 2) as usize {
            return Err(invalid("text is too long to tokenize"));
        }
        let add_special = add_special.unwrap_or(self.add_bos);
        let tokens = self
            .llama
            .vocab()
            .tokenize(text.as_bytes(), add_special, parse_special);
        Ok(tokens.into_iter().map(|t| t.0).collect())
    }

    /// Detokenize to a string. Invalid UTF-8 (a sequence cut inside a
    /// character) is replaced with U+FFFD rather than raising.
    pub fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<String> {
        self.check_tokens(tokens)?;
        if tokens.is_empty() {
            return Ok(String::new());
        }
        let tokens: Vec<LlamaToken> = tokens.iter().map(|&t| LlamaToken(t)).collect();
        let bytes = self
            .llama
            .vocab()
            .detokenize(&tokens, false, render_special);
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The raw bytes of one token's text (may be part of a UTF-8 sequence).
    pub fn token_bytes(&self, token: i32, render_special: bool) -> Result<Vec<u8>> {
        self.check_token(token)?;
        Ok(self
            .llama
            .vocab()
            .token_to_piece(LlamaToken(token), render_special, None))
    }

    /// Give `sampler` this vocabulary's DRY breaker tokens: every token whose
    /// text contains one of its `dry_sequence_breakers` (computed once per
    /// set of breakers).
    pub fn bind_sampler(&self, sampler: &mut Sampler) {
        let p = sampler.params();
        if p.dry_multiplier <= 0.0 {
            return;
        }
        let key = p.dry_sequence_breakers.clone();
        let mut cache = self
            .dry_breakers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let set = cache
            .entry(key)
            .or_insert_with_key(|breakers| {
                let needles: Vec<&[u8]> = breakers
                    .iter()
                    .map(|b| b.as_bytes())
                    .filter(|b| !b.is_empty())
                    .collect();
                let tokens = (0..self.info.vocab_size as i32)
                    .filter(|&t| {
                        let piece = self.token_bytes(t, false).unwrap_or_default();
                        needles
                            .iter()
                            .any(|n| piece.windows(n.len()).any(|w| w == *n))
                    })
                    .collect();
                Arc::new(tokens)
            })
            .clone();
        drop(cache);
        sampler.set_dry_breakers(set);
    }

    /// KV cache bytes one cell takes (every layer's K and V), from the GGUF
    /// hyper-parameters: an estimate, llama.cpp adds small buffers on top.
    pub fn kv_bytes_per_cell(&self, type_k: KvType, type_v: KvType) -> u64 {
        let m = &self.llama;
        let arch = &self.info.architecture;
        let meta_u64 = |key: &str| {
            self.meta(&format!("{arch}.{key}"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        let n_head = u64::from(m.n_head().max(1));
        let head_dim = u64::from(self.info.n_embd) / n_head;
        let k_len = meta_u64("attention.key_length").unwrap_or(head_dim);
        let v_len = meta_u64("attention.value_length").unwrap_or(head_dim);
        let n_head_kv = u64::from(m.n_head_kv());
        u64::from(m.n_layer())
            * n_head_kv
            * (k_len as f64 * type_k.bytes_per_element()
                + v_len as f64 * type_v.bytes_per_element()) as u64
    }

    /// The text of `text` when it is exactly one token, else `None`.
    pub fn single_token(&self, text: &str) -> Option<i32> {
        match self.tokenize(text, Some(false), true).ok()?.as_slice() {
            [t] => Some(*t),
            _ => None,
        }
    }
}

/// Check the file before llama.cpp sees it: a missing file, a directory or a
/// non-GGUF file gets a precise error instead of llama.cpp's generic failure,
/// and the header's hyper-parameters that llama.cpp asserts on (a block
/// count of 0, say) are refused here instead of aborting the process.
/// Returns the open file (kept open while llama.cpp loads it).
fn check_gguf_file(path: &Path) -> Result<std::fs::File> {
    if path.is_dir() {
        return Err(Error::ModelIsDirectory(path.to_path_buf()));
    }
    if !path.is_file() {
        return Err(Error::ModelNotFound(path.to_path_buf()));
    }
    let refuse = |reason: String| Error::ModelLoad {
        path: path.to_path_buf(),
        reason,
    };
    let mut file =
        std::fs::File::open(path).map_err(|e| refuse(format!("cannot open the file: {e}")))?;
    gguf::read_header(&mut file)
        .and_then(|h| gguf::check_hparams(&h))
        .map_err(|e| refuse(e.0))?;
    Ok(file)
}

/// `/proc/self/fd/N` for an open file, where the platform has it.
fn fd_path(file: &std::fs::File) -> Option<PathBuf> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let p = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
        p.exists().then_some(p)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = file;
        None
    }
}
