"""llama.cpp's Vulkan backend, the run-time module ``libggml-vulkan.so`` in
the wheel (scripts/build_vulkan_module.sh).

``make test-vulkan`` runs these against the wheel on Mesa's software Vulkan
device (lavapipe, a CPU pretending to be a GPU: slow, but the same Vulkan
code path a GPU takes). Elsewhere they are skipped: a source build
(``make dev``) has no Vulkan module, and ggml ignores CPU-type Vulkan devices
unless ``GGML_VK_VISIBLE_DEVICES`` names them.

The CPU and Vulkan are two routes: greedy tokens are compared up to the first
near-tie and logits within ``ROUTE_NOISE`` (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import lloyal
import numpy as np
import pytest
from lloyal.models import model_path

from tests._hang import HANG_GUARD_S
from tests.conftest import COUNTING, MODELS, ROUTE_NOISE, greedy_reference, top1_margin


def _vulkan_devices() -> list[lloyal.Device]:
    return [d for d in lloyal.backend_info().devices if d.backend == "Vulkan"]


pytestmark = [
    pytest.mark.vulkan,
    pytest.mark.skipif(
        not _vulkan_devices(),
        reason="no Vulkan device (make test-vulkan: the wheel with its Vulkan module, on lavapipe)",
    ),
]


@pytest.fixture(scope="module", params=MODELS)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[str, lloyal.Context, lloyal.Context]]:
    """The model on the CPU and with every layer on the Vulkan device."""
    path = model_path(request.param)

    async def open_both() -> tuple[lloyal.Context, lloyal.Context]:
        cpu = await lloyal.create_context(path, n_ctx=512, n_seq_max=4, n_gpu_layers=0)
        gpu = await lloyal.create_context(path, n_ctx=512, n_seq_max=4, n_gpu_layers=-1)
        return cpu, gpu

    cpu, gpu = asyncio.run(open_both())
    yield request.param, cpu, gpu
    cpu.close()
    gpu.close()


def _offload(model: Path, **options: object) -> tuple[int, int, int]:
    """Open a context in a child process with llama.cpp's log on; return
    the context's ``n_gpu_layers`` and llama.cpp's "offloaded X/Y layers"."""
    code = textwrap.dedent(
        """
        import asyncio, json, sys, lloyal
        async def main():
            ctx = await lloyal.create_context(sys.argv[1], **json.loads(sys.argv[2]))
            async with ctx:
                print(ctx.n_gpu_layers)
        asyncio.run(main())
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(model), json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        env={**os.environ, "LLOYAL_LOG": "1"},
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # The last report is the load's (with auto, the fit's trial loads come first).
    found = re.findall(r"offloaded (\d+)/(\d+) layers to GPU", run.stderr)
    assert found, run.stderr[-3000:]
    return int(run.stdout.strip()), int(found[-1][0]), int(found[-1][1])


def test_lloyal_info_lists_the_vulkan_device(smollm2: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lloyal", "info", "--model", str(smollm2), "--n-ctx", "256"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    name = _vulkan_devices()[0].name
    assert re.search(rf"^gpu\s+.*\b{name}\b", result.stdout, re.M), result.stdout
    # auto, with 1 GiB left free: a 135M model fits whole.
    assert re.search(r"^gpu layers \(auto\)\s+all 31\b", result.stdout, re.M), result.stdout


def test_every_layer_goes_to_the_device(smollm2: Path) -> None:
    layers, offloaded, total = _offload(smollm2, n_ctx=256, n_gpu_layers=-1)
    assert layers == -1
    assert offloaded == total == 31  # 30 blocks and the output layer


def test_auto_fits_fewer_layers_into_a_small_budget(smollm2: Path) -> None:
    """``n_gpu_layers="auto"`` with ``fit_margin`` leaving only part of the
    model's size free: llama.cpp's fit offloads some layers, not all, and the
    context loads with the count it chose."""
    free = _vulkan_devices()[0].memory_free
    size = smollm2.stat().st_size

    def fitted(budget: int) -> int:
        return lloyal.fit_gpu_layers(smollm2, n_ctx=256, fit_margin=max(0, free - budget))

    assert fitted(64 * size) == -1  # room for everything: every layer
    assert fitted(0) == 0  # room for nothing: none
    # Between the two, a budget that takes some: the fit's own accounting
    # (weights per layer, KV cache, compute buffers) decides how many.
    low, high = 0, 64 * size
    budget, some = high, -1
    while high - low > 1 << 20 and some in (0, -1):
        budget = (low + high) // 2
        some = fitted(budget)
        low, high = (budget, high) if some == 0 else (low, budget)
    assert 0 < some < 31, (budget, some)
    layers, offloaded, total = _offload(smollm2, n_ctx=256, fit_margin=max(0, free - budget))
    assert layers == offloaded == some  # lavapipe's memory does not move
    assert total == 31


def test_greedy_tokens_and_logits_match_the_cpu(
    pair: tuple[str, lloyal.Context, lloyal.Context],
) -> None:
    name, cpu, gpu = pair

    async def main() -> None:
        want = await greedy_reference(cpu, COUNTING[name], 12)
        got = await greedy_reference(gpu, COUNTING[name], 12)
        want.check(got.tokens, at_least=8)
        # The prompt's logits, both routes.
        prompt = await cpu.tokenize(COUNTING[name])
        await cpu.decode(prompt, 0)
        await gpu.decode(prompt, 0)
        try:
            np.testing.assert_allclose(gpu.get_logits(), cpu.get_logits(), rtol=0, atol=ROUTE_NOISE)
        finally:
            await cpu.kv_cache_remove(0, 0)
            await gpu.kv_cache_remove(0, 0)

    asyncio.run(main())


def test_forks_and_batched_commits_on_the_device(
    pair: tuple[str, lloyal.Context, lloyal.Context],
) -> None:
    """Three forks of one root committed together (one decode per step) on
    the device follow the CPU's single-branch greedy path; a fork steered
    elsewhere diverges without disturbing its siblings."""
    name, cpu, gpu = pair

    async def main() -> None:
        want = await greedy_reference(cpu, COUNTING[name], 6)
        store = lloyal.BranchStore(gpu)
        async with lloyal.Branch.create(gpu, params=lloyal.GREEDY) as root:
            await root.prefill(await gpu.tokenize(COUNTING[name]))
            family = [await root.fork() for _ in range(3)]
            odd = (await gpu.tokenize(" banana", add_special=False))[0]
            family[2].steer({odd: 100.0})
            decodes = gpu.stats.decode_calls
            tokens: list[list[int]] = [[], [], []]
            for _ in range(6):
                produced = [(b, (await b.produce()).token) for b in family]
                await store.commit(produced)
                for out, (_, token) in zip(tokens, produced, strict=True):
                    out.append(token)
            assert gpu.stats.decode_calls == decodes + 6  # one decode per step
            want.check(tokens[0], at_least=4)
            assert tokens[1] == tokens[0]
            assert tokens[2][0] == odd != tokens[0][0]
            assert top1_margin(family[0].logits) > 0
            for b in family:
                assert b.position == root.position + 6
                await b.prune()

    asyncio.run(main())
