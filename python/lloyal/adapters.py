"""LoRA adapters and control vectors, per branch.

llama.cpp loads an adapter into a model and applies a *set* of them
(adapters with scales, plus at most one control vector) to a context's
decodes. lloyal gives every branch its own set: :meth:`Branch.set_adapters
<lloyal.Branch.set_adapters>`, inherited by forks. Branches under different
sets still share a step: the worker decodes each set's tokens together, one
``llama_decode`` per set in use (as llama-server does with per-request
LoRA), so requests with the same set share their decodes and requests with
different sets never mix. :meth:`Context.set_adapters
<lloyal.Context.set_adapters>` sets the context's default: what new
branches start with, and what the flat API and embeddings decode under.

A set applies to what a branch decodes *from now on*: KV cells already
written (a shared prompt, a fork's prefix) keep what they were computed
under. The prefix cache and the server key their reuse on the set.

>>> import asyncio, lloyal
>>> from lloyal import fixtures
>>> async def main():
...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
...         lora = await ctx.load_lora(fixtures.lora("random"))
...         prompt = await ctx.tokenize("The capital of France is")
...         base = lloyal.Branch.create(ctx)
...         tuned = lloyal.Branch.create(ctx)
...         tuned.set_adapters({lora: 1.0})
...         await lloyal.BranchStore(ctx).prefill([(base, prompt), (tuned, prompt)])
...         changed = bool((base.logits != tuned.logits).any())
...         return changed, tuned.adapters.loras[0][1], base.adapters.loras
>>> asyncio.run(main())
(True, 1.0, ())

A file that does not fit the model raises :class:`AdapterLoadError
<lloyal.AdapterLoadError>` (a missing one ``FileNotFoundError``) and
changes nothing; docs/adapters.md has the formats and the checks.
"""

from __future__ import annotations

import numbers
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeAlias

from lloyal._lloyal import ControlVector, Lora

LoraSpec: TypeAlias = "Lora | Mapping[Lora, float] | Iterable[Lora | tuple[Lora, float]] | None"
"""What ``loras=`` takes: one adapter (scale 1), a mapping of adapters to
scales, or a list of adapters and ``(adapter, scale)`` pairs; ``None`` or
empty: no adapter."""


@dataclass(frozen=True)
class Adapters:
    """A set of adapters: LoRAs with their scales, in order, and at most one
    control vector. ``Adapters()`` is the base model."""

    loras: tuple[tuple[Lora, float], ...] = ()
    control_vector: ControlVector | None = None


def normalized(a: Adapters) -> Adapters:
    """``a`` as a branch holds it: adapters at scale 0 left out, scales
    rounded to float32 (what the engine keeps), tuples throughout (a key)."""
    return Adapters(
        tuple((lora, _f32(scale)) for lora, scale in a.loras if scale != 0.0),
        a.control_vector,
    )


def _f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def split(
    loras: object, control_vector: object
) -> tuple[list[Lora], list[float], ControlVector | None]:
    """``loras`` (a :data:`LoraSpec`) as adapters and scales; checks types."""
    pairs: list[tuple[object, object]]
    if loras is None:
        pairs = []
    elif isinstance(loras, Lora):
        pairs = [(loras, 1.0)]
    elif isinstance(loras, Mapping):
        pairs = list(loras.items())
    elif isinstance(loras, Iterable) and not isinstance(loras, (str, bytes)):
        pairs = [item if isinstance(item, tuple) else (item, 1.0) for item in loras]
    else:
        raise TypeError(
            f"loras must be a Lora, a mapping or a list of them, got {type(loras).__name__}"
        )
    adapters: list[Lora] = []
    scales: list[float] = []
    for pair in pairs:
        if len(pair) != 2 or not isinstance(pair[0], Lora):
            raise TypeError(f"each LoRA must be a Lora or a (Lora, scale) pair, got {pair!r}")
        scale = pair[1]
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"a LoRA scale must be a real number, got {type(scale).__name__}")
        adapters.append(pair[0])
        scales.append(float(scale))
    if control_vector is not None and not isinstance(control_vector, ControlVector):
        raise TypeError(
            f"control_vector must be a ControlVector, got {type(control_vector).__name__}"
        )
    return adapters, scales, control_vector


def adapters(native: tuple[list[tuple[Lora, float]], ControlVector | None]) -> Adapters:
    """The native ``(loras, control)`` pair as :class:`Adapters`."""
    loras, control = native
    return Adapters(tuple(loras), control)


__all__ = ["Adapters", "ControlVector", "Lora", "LoraSpec"]
