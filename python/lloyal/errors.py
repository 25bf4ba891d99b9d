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


__all__ = [
    "AdapterLoadError",
    "BranchBusyError",
    "BranchDisposedError",
    "ChatTemplateError",
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
    "StateError",
    "WorkerLostError",
]
