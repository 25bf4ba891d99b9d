"""Windows against Linux, on the same machine (make test-windows).

scripts/windows/test.sh first writes, with the Linux build, the greedy
continuations of a few prompts on both test models
(``python tests/test_windows.py OUT.json``), then runs the suite on Windows'
CPython under Wine with ``LLOYAL_LINUX_GREEDY`` naming that file: Windows
must choose the same tokens up to the first near-tie (the two builds are
different decoding routes: another compiler, another CPU module; see
``ROUTE_NOISE``). Elsewhere these tests are skipped, saying why. The other
Windows checks are the suite itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import lloyal
import pytest
from lloyal.models import model_path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.conftest import MODELS, Greedy, greedy_reference

# Prompts whose greedy continuations have long runs of clear choices on
# both models (15-16 and 4-7 steps of margin >= ROUTE_NOISE), and one of
# near-ties (compared up to its first).
PROMPTS = [
    "1, 2, 3, 4, 5,",
    "a b c d e f g",
    "The capital of France is",
]
STEPS = 16


async def _greedy(name: str) -> dict[str, dict[str, list[float]]]:
    async with await lloyal.create_context(model_path(name), n_ctx=256) as ctx:
        out = {}
        for prompt in PROMPTS:
            g = await greedy_reference(ctx, prompt, STEPS)
            out[prompt] = {"tokens": g.tokens, "margins": g.margins}
        return out


def _reference() -> dict[str, dict[str, dict[str, list[float]]]]:
    path = os.environ.get("LLOYAL_LINUX_GREEDY")
    if sys.platform != "win32" or not path:
        pytest.skip("compares Windows with Linux: make test-windows sets LLOYAL_LINUX_GREEDY")
    return json.loads(Path(path).read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_equal_linuxs(name: str) -> None:
    linux = _reference()[name]
    here = asyncio.run(_greedy(name))
    compared = 0
    for prompt in PROMPTS:
        ref = linux[prompt]
        reference = Greedy([int(t) for t in ref["tokens"]], ref["margins"], [])
        compared += reference.check(here[prompt]["tokens"], at_least=0)
    assert compared >= 12, "too few clear steps to compare"


if __name__ == "__main__":
    result = {name: asyncio.run(_greedy(name)) for name in MODELS}
    Path(sys.argv[1]).write_text(json.dumps(result))
