"""The exception hierarchy. Everything lloyal raises on purpose is a
``LloyalError`` subclass, except where Python has a better-known builtin:
``FileNotFoundError`` for a missing model (``IsADirectoryError`` for a
directory), ``ValueError`` for bad arguments (token ids out of range,
positions that do not continue a sequence, empty input), ``TypeError`` for
arguments of the wrong type, and ``MemoryError`` for a KV cache larger than
the memory available. docs/limits.md lists every bound and what crossing it
raises.

>>> import lloyal
>>> issubclass(lloyal.KVCacheFullError, lloyal.DecodeError)
True
>>> issubclass(lloyal.ModelLoadError, lloyal.LloyalError)
True
>>> issubclass(lloyal.ChecksumMismatchError, lloyal.PullError)
True
"""

from lloyal._lloyal import (
    AdapterLoadError,
    BranchBusyError,
    BranchDisposedError,
    ChatTemplateError,
    ContextClosedError,
    DecodeError,
    GrammarError,
    InternalError,
    KVCacheFullError,
    LloyalError,
    MediaError,
    ModelLoadError,
    NoLeaseError,
    ProjectorLoadError,
    StateError,
)


class WorkerLostError(LloyalError):
    """A remote context (a :mod:`lloyal.cluster` worker) died; the branches
    it held are gone. Other workers and their branches are unaffected."""


class PullError(LloyalError):
    """A model could not be pulled from the Hugging Face hub or a URL
    (:mod:`lloyal.hub`): the network failed (and the cache lacks the file),
    the server answered an HTTP error, an answer of the hub was refused
    (a name that would leave the cache, a body past its listed size, a file
    list without end), or ``huggingface_hub`` is not installed."""


class PullNotFoundError(PullError):
    """What a pull asked for is not there: the repository, revision or file
    answers 404 (or 401/403: private or gated, and ``$HF_TOKEN`` unset or
    without access), or no ``.gguf`` file of the repository matches the
    quantization asked for (the message lists the files there are)."""


class ChecksumMismatchError(PullError):
    """Downloaded bytes whose SHA-256 (or size) is not the one the hub gives,
    or the one a URL's ``#sha256=`` fragment names. The download is deleted;
    nothing is cached."""


__all__ = [
    "AdapterLoadError",
    "BranchBusyError",
    "BranchDisposedError",
    "ChatTemplateError",
    "ChecksumMismatchError",
    "ContextClosedError",
    "DecodeError",
    "GrammarError",
    "InternalError",
    "KVCacheFullError",
    "LloyalError",
    "MediaError",
    "ModelLoadError",
    "NoLeaseError",
    "ProjectorLoadError",
    "PullError",
    "PullNotFoundError",
    "StateError",
    "WorkerLostError",
]
