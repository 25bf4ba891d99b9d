"""Test artifacts made here from nothing downloaded: adapter files with
random weights of a test model's shapes, written with llama.cpp's own
``gguf`` package (``pip install gguf``; the ``test`` extra has it) and kept
in :func:`lloyal.models.cache_dir` like the test models.

- :func:`lora`: a LoRA for SmolLM2 (or Gemma 3) on every ``attn_q`` and
  ``attn_v``: ``"random"`` changes the model's logits, ``"zero"`` (B = 0)
  leaves them exactly as they are.
- :func:`control_vector`: a ``cvector-generator``-style file with one random
  direction per layer.

``python -m lloyal.fixtures`` (``make fixtures``) writes them all and
prints their paths; each is written once, then found in the cache.

>>> from lloyal import fixtures
>>> fixtures.lora("zero").name
'smollm2-lora-zero.gguf'
"""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np

from lloyal.models import ModelNotInstalledError, cache_dir, model_path

LoraKind = Literal["random", "zero"]

RANK = 8
ALPHA = 8.0


def _gguf() -> Any:
    try:
        # Optional, and typed only in some versions: keep mypy out of it.
        return importlib.import_module("gguf")
    except ImportError:
        raise ModelNotInstalledError("writing test fixtures needs gguf: pip install gguf") from None


def _write(target: Path, arch: str, fill: Any) -> Path:
    """Write ``target`` (through a temporary file, so that a crash leaves
    no half file in the cache)."""
    gguf = _gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.part")
    writer = gguf.GGUFWriter(partial, arch)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(target)
    return target


@functools.cache
def _shapes(model: str) -> tuple[str, dict[str, tuple[int, ...]]]:
    """The architecture and tensor shapes (innermost first) of a model."""
    reader = _gguf().GGUFReader(model_path(model))
    arch = str(reader.fields["general.architecture"].contents())
    return arch, {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}


def lora(kind: LoraKind = "random", model: str = "smollm2") -> Path:
    """A rank-8 LoRA (alpha 8) for test model ``model`` on every ``attn_q``
    and ``attn_v``: random A and B, or B all zero (``kind="zero"``)."""
    if kind not in ("random", "zero"):
        raise ValueError(f"kind must be 'random' or 'zero', got {kind!r}")
    target = cache_dir() / f"{model}-lora-{kind}.gguf"
    if target.is_file():
        return target
    arch, shapes = _shapes(model)

    def fill(w: Any) -> None:
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", ALPHA)
        rng = np.random.default_rng(29)
        for name, ne in sorted(shapes.items()):
            if not name.endswith(("attn_q.weight", "attn_v.weight")):
                continue
            n_in, n_out = ne[0], ne[1]
            # numpy shapes are outermost first: A is (rank, n_in), B (n_out, rank).
            a = rng.normal(0.0, 1.0 / np.sqrt(n_in), (RANK, n_in)).astype(np.float32)
            b = rng.normal(0.0, 0.5, (n_out, RANK)).astype(np.float32)
            w.add_tensor(f"{name}.lora_a", a)
            w.add_tensor(f"{name}.lora_b", b if kind == "random" else np.zeros_like(b))

    return _write(target, arch, fill)


def control_vector(model: str = "smollm2") -> Path:
    """A control vector for test model ``model``: one random direction
    (norm 4) for every layer from 1, as ``cvector-generator`` writes."""
    target = cache_dir() / f"{model}-control-vector.gguf"
    if target.is_file():
        return target
    arch, shapes = _shapes(model)
    n_embd = shapes["token_embd.weight"][0]
    n_layer = 1 + max(int(n.split(".")[1]) for n in shapes if n.startswith("blk."))

    def fill(w: Any) -> None:
        w.add_string("controlvector.model_hint", arch)
        w.add_uint32("controlvector.layer_count", n_layer - 1)
        rng = np.random.default_rng(29)
        for layer in range(1, n_layer):
            v = rng.normal(0.0, 1.0, n_embd).astype(np.float32)
            w.add_tensor(f"direction.{layer}", v * (4.0 / np.linalg.norm(v)))

    return _write(target, "controlvector", fill)


def build_all() -> list[Path]:
    """Write every fixture (for each test model installed)."""
    return [
        *(lora(kind, model) for model in ("smollm2", "gemma3") for kind in ("random", "zero")),
        *(control_vector(model) for model in ("smollm2", "gemma3")),
    ]


if __name__ == "__main__":
    for path in build_all():
        print(path)
