"""Sampling parameters: :class:`SamplingParams` is the engine's own
(``lloyal_core::SamplingParams``), built and checked natively."""

from __future__ import annotations

from lloyal._lloyal import SamplingParams

__all__ = ["GREEDY", "SamplingParams"]

GREEDY = SamplingParams(temperature=0.0)
"""Greedy decoding: always the most likely token."""
