//! The one error type of the engine. The Python bindings map each variant to
//! one exception class in a single place (`lloyal-py/src/errors.rs`).

use std::path::PathBuf;

/// Everything that can go wrong in the engine.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The model path does not exist.
    #[error("model file not found: {0}")]
    ModelNotFound(PathBuf),
    /// The model path is a directory.
    #[error("model path is a directory, not a GGUF file: {0}")]
    ModelIsDirectory(PathBuf),
    /// The file exists but llama.cpp could not load it (not a GGUF, unsupported
    /// architecture, truncated file...).
    #[error("could not load model {path}: {reason}")]
    ModelLoad { path: PathBuf, reason: String },
    /// The adapter (LoRA or control vector) path does not exist.
    #[error("adapter file not found: {0}")]
    AdapterNotFound(PathBuf),
    /// The adapter file is not one this model can use (not a GGUF adapter,
    /// another architecture, shapes that do not match, truncated...).
    #[error("could not load adapter {path}: {reason}")]
    AdapterLoad { path: PathBuf, reason: String },
    /// The projector (mmproj) file is not one this model can use (not a
    /// projector, a key of the wrong type, another model's width...).
    #[error("could not load projector {path}: {reason}")]
    ProjectorLoad { path: PathBuf, reason: String },
    /// Media (an image or audio clip) that cannot be used: corrupt,
    /// truncated, too large, a format libmtmd does not read, or a kind the
    /// projector does not take.
    #[error("bad media: {0}")]
    Media(String),
    /// llama.cpp refused to create a context with these parameters.
    #[error("could not create context: {0}")]
    ContextCreate(String),
    /// Not enough memory for what was asked (maps to `MemoryError`).
    #[error("not enough memory: {0}")]
    OutOfMemory(String),
    /// The context was closed; nothing more can run on it.
    #[error("the context is closed")]
    ContextClosed,
    /// A caller passed a value the API does not accept (maps to `ValueError`).
    #[error("{0}")]
    InvalidArgument(String),
    /// `llama_decode` failed for a reason other than a full KV cache.
    #[error("decode failed: {0}")]
    Decode(String),
    /// No free KV cell slot for the batch (llama_decode returned 1).
    #[error("KV cache is full: {0}")]
    KvCacheFull(String),
    /// KV state data is corrupt, truncated, or from another model/context.
    #[error("invalid KV state: {0}")]
    State(String),
    /// A chat template could not be found, parsed or rendered.
    #[error("chat template error: {0}")]
    Template(String),
    /// A grammar or JSON schema could not be compiled, or a token it
    /// forbids was accepted.
    #[error("grammar error: {0}")]
    Grammar(String),
    /// The branch was pruned (or its handle is stale).
    #[error("the branch was pruned; its handle is no longer valid")]
    BranchDisposed,
    /// The branch has an operation in flight.
    #[error("the branch already has an operation in flight; await it first")]
    BranchBusy,
    /// No KV sequence is free for a new branch.
    #[error("no KV lease free: {0}")]
    NoLease(String),
    /// The caller gave up on the operation (see [`Reply::cancel_with`]) before
    /// it finished: it was undone, as if never issued.
    ///
    /// [`Reply::cancel_with`]: crate::engine::Reply::cancel_with
    #[error("cancelled by its caller before it finished; nothing of it happened")]
    Cancelled,
    /// A panic inside the engine, caught before it could cross into Python.
    #[error("internal error (please report): {0}")]
    Internal(String),
}

/// Result alias used across the engine.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Build an [`Error::Internal`] from a caught panic payload.
    pub fn from_panic(payload: Box<dyn std::any::Any + Send>) -> Self {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        Error::Internal(message)
    }
}

/// Shorthand for an [`Error::InvalidArgument`].
pub(crate) fn invalid(message: impl Into<String>) -> Error {
    Error::InvalidArgument(message.into())
}
