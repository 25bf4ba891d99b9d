//! The one place where engine errors become Python exceptions.

use lloyal_core::Error;
use pyo3::create_exception;
use pyo3::exceptions::{
    PyException, PyFileNotFoundError, PyIsADirectoryError, PyMemoryError, PyValueError,
};
use pyo3::prelude::*;

create_exception!(
    lloyal,
    LloyalError,
    PyException,
    "Base class of every lloyal error."
);
create_exception!(
    lloyal,
    ModelLoadError,
    LloyalError,
    "The file is not a loadable GGUF model."
);
create_exception!(
    lloyal,
    AdapterLoadError,
    LloyalError,
    "The file is not a LoRA adapter or control vector this model can use."
);
create_exception!(
    lloyal,
    ProjectorLoadError,
    LloyalError,
    "The file is not a projector (mmproj) this model can use."
);
create_exception!(
    lloyal,
    MediaError,
    LloyalError,
    "An image or audio clip that cannot be used: corrupt, truncated, too large, \
     or a kind the projector does not take."
);
create_exception!(
    lloyal,
    ContextClosedError,
    LloyalError,
    "The context was closed."
);
create_exception!(lloyal, DecodeError, LloyalError, "llama_decode failed.");
create_exception!(
    lloyal,
    KVCacheFullError,
    DecodeError,
    "No room left in the KV cache."
);
create_exception!(
    lloyal,
    GrammarError,
    LloyalError,
    "A grammar or JSON schema is invalid."
);
create_exception!(
    lloyal,
    StateError,
    LloyalError,
    "KV state data is corrupt or foreign."
);
create_exception!(
    lloyal,
    BranchDisposedError,
    LloyalError,
    "The branch was pruned."
);
create_exception!(
    lloyal,
    BranchBusyError,
    LloyalError,
    "The branch has an operation in flight."
);
create_exception!(
    lloyal,
    NoLeaseError,
    LloyalError,
    "No KV sequence is free for a new branch."
);
create_exception!(
    lloyal,
    ChatTemplateError,
    LloyalError,
    "A chat template is missing or broken."
);
create_exception!(
    lloyal,
    InternalError,
    LloyalError,
    "A bug in lloyal; please report it."
);

/// Convert an engine error to the matching Python exception.
pub fn to_pyerr(error: Error) -> PyErr {
    let message = error.to_string();
    match error {
        Error::ModelNotFound(_) | Error::AdapterNotFound(_) => {
            PyFileNotFoundError::new_err(message)
        }
        Error::AdapterLoad { .. } => AdapterLoadError::new_err(message),
        Error::ProjectorLoad { .. } => ProjectorLoadError::new_err(message),
        Error::Media(_) => MediaError::new_err(message),
        Error::ModelIsDirectory(_) => PyIsADirectoryError::new_err(message),
        Error::OutOfMemory(_) => PyMemoryError::new_err(message),
        Error::ModelLoad { .. } | Error::ContextCreate(_) => ModelLoadError::new_err(message),
        Error::ContextClosed => ContextClosedError::new_err(message),
        Error::InvalidArgument(_) => PyValueError::new_err(message),
        Error::Decode(_) => DecodeError::new_err(message),
        Error::KvCacheFull(_) => KVCacheFullError::new_err(message),
        Error::Template(_) => ChatTemplateError::new_err(message),
        Error::State(_) => StateError::new_err(message),
        Error::Internal(_) => InternalError::new_err(message),
        Error::BranchDisposed => BranchDisposedError::new_err(message),
        Error::BranchBusy => BranchBusyError::new_err(message),
        Error::NoLease(_) => NoLeaseError::new_err(message),
        // Answers a wait that was cancelled: nobody reads it.
        Error::Cancelled => pyo3::exceptions::asyncio::CancelledError::new_err(message),
        Error::Grammar(_) => GrammarError::new_err(message),
    }
}

/// `Result` to `PyResult`.
pub trait IntoPyResult<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, Error> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_pyerr)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("LloyalError", py.get_type::<LloyalError>())?;
    m.add("ModelLoadError", py.get_type::<ModelLoadError>())?;
    m.add("AdapterLoadError", py.get_type::<AdapterLoadError>())?;
    m.add("ProjectorLoadError", py.get_type::<ProjectorLoadError>())?;
    m.add("MediaError", py.get_type::<MediaError>())?;
    m.add("ContextClosedError", py.get_type::<ContextClosedError>())?;
    m.add("DecodeError", py.get_type::<DecodeError>())?;
    m.add("KVCacheFullError", py.get_type::<KVCacheFullError>())?;
    m.add("GrammarError", py.get_type::<GrammarError>())?;
    m.add("StateError", py.get_type::<StateError>())?;
    m.add("BranchDisposedError", py.get_type::<BranchDisposedError>())?;
    m.add("BranchBusyError", py.get_type::<BranchBusyError>())?;
    m.add("NoLeaseError", py.get_type::<NoLeaseError>())?;
    m.add("ChatTemplateError", py.get_type::<ChatTemplateError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}
