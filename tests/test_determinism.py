"""create_context(deterministic=True): a branch's logits do not depend on
how its work was laid out (docs/determinism.md). Bit-identical, on both
models, whatever CPU runs the suite: alone or in a batch of 8 at any row,
one call or split, fresh or reused KV cells, the README-branch-store
example against each branch alone, batched or single embeddings; and
speculative decoding (draft model, tree, prompt lookup) returns the greedy
tokens exactly.

Each check runs in a fresh interpreter (determinism_child.py): the mode
must be set up before anything in the process decodes, and this process
has decoded long before these tests run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lloyal
import pytest

from tests._child import run_child
from tests._hang import HANG_GUARD_S

CHILD = Path(__file__).with_name("determinism_child.py")


def run_check(model: Path, check: str) -> dict[str, Any]:
    result: dict[str, Any] = run_child(CHILD, str(model), check)
    return result


def test_alone_or_in_a_batch_of_8_at_any_row(model: Path) -> None:
    got = run_check(model, "batch")
    assert got == {"batch": [0.0] * 8, "reversed": [0.0] * 8}


def test_one_call_or_split(model: Path) -> None:
    assert run_check(model, "split") == {"1": 0.0, "7": 0.0, "64": 0.0}


def test_fresh_or_reused_cells(model: Path) -> None:
    assert run_check(model, "reused_cells") == {"steps": [0.0] * 4}


def test_dropped_cells_are_freed_when_the_cache_is_full(smollm2: Path) -> None:
    assert run_check(smollm2, "purge") == {"purges": 1, "position": True}


def test_readme_branch_store_example_equals_each_branch_alone(model: Path) -> None:
    assert run_check(model, "four_branches") == {"branches": [[0.0] * 7] * 4}


def test_batched_embeddings_equal_single_ones(model: Path) -> None:
    got = run_check(model, "embeddings")
    assert got["rows"] == [0.0] * 4
    assert got["cosine_to_usual"] >= 0.999


def test_speculation_is_exactly_greedy(model: Path) -> None:
    got = run_check(model, "speculation")
    n = len(got["plain"])
    assert n == 10
    for name in ("draft", "tree", "lookup", "sibling"):
        assert got[name] == got["plain"], name
    # The model drafting for itself: every draft accepted, k + 1 tokens
    # verified per round (a chain), more with the tree's siblings.
    assert got["draft_acceptance"] == [1.0] * n
    assert got["tree_acceptance"] == [1.0] * n
    assert all(v <= 5 for v in got["draft_verified_per_round"])
    assert all(v > 5 for v in got["tree_verified_per_round"])
    # Drafting its second choice: the right token is always the sibling.
    assert all(a > 0 for a in got["sibling_accepted"])
    assert got["leases_left"] == 4


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_deterministic_needs_a_quantized_cache(smollm2: Path) -> None:
    with pytest.raises(ValueError, match="quantized KV cache"):
        await lloyal.create_context(smollm2, deterministic=True, type_k="f16")


def test_deterministic_after_a_decode_needs_the_variable_set() -> None:
    """This process has decoded (the rest of the suite): llama.cpp has read
    GGML_CPU_TILED_MM already, so the mode cannot be promised any more."""
    code = """
import asyncio, lloyal
from lloyal.models import default_model_path
async def main():
    async with await lloyal.create_context(default_model_path()) as ctx:
        await ctx.decode(await ctx.tokenize("Hi"), 0)
    try:
        async with await lloyal.create_context(default_model_path(), deterministic=True):
            pass
    except ValueError as e:
        print("refused:", e)
asyncio.run(main())
"""
    env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "refused:" in proc.stdout
    assert "GGML_CPU_TILED_MM" in proc.stdout
    env["GGML_CPU_TILED_MM"] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "refused:" not in proc.stdout
