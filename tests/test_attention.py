"""The project's flash attention patch (patches/llama.cpp/0001-*): llama.cpp's
CPU kernel reads only the KV cells each row may see. Each scenario runs
twice in fresh interpreters (attention_child.py), with the patch and with
it switched off (``GGML_CPU_DISABLE_FA_SPARSE=1``: upstream's dense scan),
and compares what came out:

- deterministic mode (the per-row kernel for every batch): the same bits
  with 1, 8 and 64 forks in lockstep, on both models;
- default mode, one sequence (the tiled kernel's causal rows, the
  single-row decode that splits cells among threads) and two prompts of 32
  forks each (dense rows, each KV tile computed for the rows that see it):
  the same bits;
- default mode, 64 distinct short prompts in lockstep: the rows see a few
  cells of each KV tile, so with the patch they leave the tiled kernel for
  the per-row one. Their bits are then exactly upstream's for the same
  rounds in decodes of 8 (upstream's per-row kernel), and differ from
  upstream's 64-token decode (its tiled kernel): the patch is in the build
  and chose the kernel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._child import run_child

CHILD = Path(__file__).with_name("attention_child.py")
SWITCH = "GGML_CPU_DISABLE_FA_SPARSE"


def run(model: Path, scenario: str, *, patched: bool) -> list[list[dict[str, Any]]]:
    steps: list[list[dict[str, Any]]] = run_child(
        CHILD, str(model), scenario, env={} if patched else {SWITCH: "1"}
    )
    return steps


def shas(steps: list[list[dict[str, Any]]]) -> list[list[str]]:
    return [[r["sha"] for r in step] for step in steps]


@pytest.mark.parametrize("n", [1, 8, 64])
def test_deterministic_forks_get_the_same_bits_as_upstream(model: Path, n: int) -> None:
    patched = run(model, f"forks_{n}", patched=True)
    assert [len(step) for step in patched] == [1, n, n, n]
    assert shas(patched) == shas(run(model, f"forks_{n}", patched=False))


@pytest.mark.parametrize("scenario", ["one_sequence", "two_prompts"])
def test_dense_rows_get_the_same_bits_as_upstream(model: Path, scenario: str) -> None:
    patched = run(model, scenario, patched=True)
    assert shas(patched) == shas(run(model, scenario, patched=False))


def test_sparse_rows_get_upstreams_per_row_bits(model: Path) -> None:
    patched = run(model, "many_prompts", patched=True)
    assert [len(step) for step in patched] == [64, 64, 64]
    # Upstream computes these rows with its per-row kernel when a decode
    # holds fewer than 64 tokens: the patched 64-token decode gives exactly
    # those bits, ...
    assert shas(patched) == shas(run(model, "many_prompts_by_8", patched=False))
    # ... and so does the patch in decodes of 8 ...
    assert shas(run(model, "many_prompts_by_8", patched=True)) == shas(patched)
    # ... where upstream's 64-token decode takes its tiled kernel (f32
    # accumulation, where the per-row kernel accumulates V in f16): other
    # bits, which shows the patch is in the build and chose the kernel.
    assert shas(run(model, "many_prompts", patched=False)) != shas(patched)
