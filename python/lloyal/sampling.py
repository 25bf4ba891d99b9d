"""Sampling parameters."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. Defaults are llama.cpp's.

    The chain runs logit bias, penalties, top-n-sigma, top-k, typical-p,
    top-p, min-p, XTC, temperature, then draws from the softmax.
    ``temperature <= 0`` is greedy (argmax after bias and penalties).
    ``mirostat=2`` (Mirostat 2.0) replaces the filters: after temperature it
    keeps tokens whose surprise in bits is within a bound that it steers
    toward ``mirostat_tau`` with rate ``mirostat_eta``. ``seed=None`` seeds
    from the OS; a fixed seed makes sampling reproducible.

    ``logit_bias`` maps token ids to additive biases (a dict or pairs).

    DRY (``dry_multiplier > 0``) runs after the penalties: a token that would
    extend a repeat of ``n >= dry_allowed_length`` earlier tokens loses
    ``dry_multiplier * dry_base ** (n - dry_allowed_length)``; tokens whose
    text contains one of ``dry_sequence_breakers`` end a repeat.
    ``dry_penalty_last_n=-1`` looks at the whole history.

    >>> from lloyal import SamplingParams
    >>> SamplingParams(temperature=0).is_greedy
    True
    >>> SamplingParams(seed=1).with_(top_k=10).top_k
    10
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "float" and (
                isinstance(value, bool) or not isinstance(value, numbers.Real)
            ):
                raise TypeError(f"{field.name} must be a float, got {type(value).__name__}")
            if field.type == "int" and (
                isinstance(value, bool) or not isinstance(value, numbers.Integral)
            ):
                raise TypeError(f"{field.name} must be an int, got {type(value).__name__}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)
        ):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        normalised = tuple((int(t), float(b)) for t, b in pairs)
        if any(t < 0 for t, _ in normalised):
            raise ValueError("logit_bias token ids must be >= 0")
        object.__setattr__(self, "logit_bias", normalised)
        if self.mirostat not in (0, 2):
            raise ValueError(f"mirostat must be 0 (off) or 2 (Mirostat 2.0), got {self.mirostat}")
        if not 0.0 <= self.xtc_probability <= 1.0:
            raise ValueError(f"xtc_probability must be in [0, 1], got {self.xtc_probability}")
        for name in ("top_p", "min_p", "typical_p"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if self.penalty_last_n < -1:
            raise ValueError(f"penalty_last_n must be >= -1, got {self.penalty_last_n}")
        breakers = self.dry_sequence_breakers
        if isinstance(breakers, str) or not all(isinstance(b, str) for b in breakers):
            raise TypeError("dry_sequence_breakers must be a sequence of strings")
        object.__setattr__(self, "dry_sequence_breakers", tuple(breakers))
        if self.dry_multiplier < 0:
            raise ValueError(f"dry_multiplier must be >= 0, got {self.dry_multiplier}")
        if self.dry_base < 1:
            raise ValueError(f"dry_base must be >= 1, got {self.dry_base}")
        if self.dry_allowed_length < 1:
            raise ValueError(f"dry_allowed_length must be >= 1, got {self.dry_allowed_length}")
        if self.dry_penalty_last_n < -1:
            raise ValueError(f"dry_penalty_last_n must be >= -1, got {self.dry_penalty_last_n}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        """Whether these parameters always pick the most likely token."""
        return self.temperature <= 0 or self.top_k == 1

    def with_(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


GREEDY = SamplingParams(temperature=0.0)
"""Greedy decoding: always the most likely token."""
