"""The same awaitables under asyncio, uvloop and trio (anyio parametrises
every test here over the three)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import anyio
import lloyal
import pytest
from lloyal import _bridge

pytestmark = pytest.mark.anyio


async def test_generate_under_each_backend(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=3) as ctx:
        prompt = await ctx.tokenize("Counting: one, two, three,")
        results: dict[int, list[int]] = {}

        async def run(seq: int) -> None:
            await ctx.decode(prompt, 0, seq)
            out = []
            for i in range(4):
                out.append(ctx.greedy_sample())
                await ctx.decode([out[-1]], len(prompt) + i, seq)
            results[seq] = out

        # Concurrent tasks on separate sequences interleave on the worker.
        async with anyio.create_task_group() as tg:
            for seq in range(3):
                tg.start_soon(run, seq)
        assert len(results) == 3


async def test_event_loop_keeps_running_during_decode(smollm2: Path) -> None:
    """Decode runs on the worker: other tasks make progress meanwhile."""
    async with await lloyal.create_context(smollm2, n_ctx=2048) as ctx:
        prompt = await ctx.tokenize("Tell me a long story about the sea. " * 40)
        ticks = 0
        done = anyio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await ctx.decode(prompt, 0)
            done.set()
        # Not a speed check: a decode that blocked the loop would let the
        # ticker run at most once; a busier machine makes the decode longer
        # and gives the ticker more turns, never fewer.
        assert ticks >= 2


async def test_cancelled_wait_leaves_a_consistent_context(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=2048) as ctx:
        prompt = await ctx.tokenize("Cancel me. " * 100)
        # Meant to expire, not a hang guard: a 300-token decode outlasts
        # 1 ms on any machine, the busier the surer.
        with anyio.move_on_after(0.001) as scope:
            await ctx.decode(prompt, 0)
        assert scope.cancelled_caught
        # The submitted decode still completes on the worker; the next call
        # queues behind it and sees the whole sequence.
        await ctx.decode([ctx.eog_token], len(prompt))
        assert ctx.kv_seq_pos_max(0) == len(prompt)


async def test_long_text_tokenizes_off_the_loop(smollm2: Path) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256) as ctx:
        text = "lorem ipsum " * 5000
        tokens = await ctx.tokenize(text, add_special=False)
        assert await ctx.detokenize(tokens) == text


class _NoReaderLoop(asyncio.SelectorEventLoop):
    """An asyncio loop that cannot watch file descriptors, as Windows'
    Proactor loop cannot."""

    def add_reader(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError


def test_a_loop_without_add_reader_is_handed_results_by_callback(smollm2: Path) -> None:
    async def main() -> tuple[list[int], list[int]]:
        # Four sequences: the flat loop's 0, and three branches.
        async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=4) as ctx:
            prompt = await ctx.tokenize("1, 2, 3, 4, 5, 6, 7, 8,")
            await ctx.decode(prompt, 0)  # call_native
            flat = [ctx.greedy_sample()]
            store = lloyal.BranchStore(ctx)
            root = lloyal.Branch.create(ctx, lloyal.GREEDY)
            await root.prefill(prompt)
            a, b = await root.fork(), await root.fork()
            branch = []
            for _ in range(3):
                pa, pb = await a.produce(), await b.produce()
                await store.commit([(a, pa.token), (b, pb.token)])  # start_batch
                branch.append(pa.token)
            await root.prune_subtree()
            # The fallback was taken: no pipe, no native queue.
            assert _bridge._wakers[asyncio.get_running_loop()]._queue is None
            return flat, branch

    loop = _NoReaderLoop()
    try:
        flat, branch = loop.run_until_complete(main())
    finally:
        loop.close()
    assert len(flat) == 1
    assert len(branch) == 3


def _decode_on(loop: asyncio.AbstractEventLoop, smollm2: Path) -> tuple[int, bool]:
    """A greedy token decoded on ``loop``, and whether the socket pair (not
    the callback fallback) woke it."""

    async def main() -> tuple[int, bool]:
        async with await lloyal.create_context(smollm2, n_ctx=256) as ctx:
            await ctx.decode(await ctx.tokenize("1, 2, 3, 4,"), 0)
            socket_pair = _bridge._wakers[asyncio.get_running_loop()]._queue is not None
            return ctx.greedy_sample(), socket_pair

    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_a_selector_loop_is_woken_through_the_socket_pair(smollm2: Path) -> None:
    """asyncio's selector loop (on Windows too, where it watches sockets
    only) takes the socket pair; Windows' default Proactor loop, which
    watches nothing, takes the callbacks, with the same token."""
    token, socket_pair = _decode_on(asyncio.SelectorEventLoop(), smollm2)
    assert socket_pair
    if sys.platform == "win32":
        proactor = asyncio.ProactorEventLoop()  # type: ignore[attr-defined,unused-ignore]
        assert _decode_on(proactor, smollm2) == (token, False)


async def test_auto_gpu_layers_offload_none_without_a_gpu(model: Path) -> None:
    """``n_gpu_layers="auto"`` (the default) costs nothing and offloads
    nothing where there is no GPU; explicit values are kept as given. (With
    a GPU: tests/test_vulkan.py.)"""
    if lloyal.supports_gpu_offload():
        pytest.skip("this build has a GPU device: tests/test_vulkan.py covers auto there")
    assert lloyal.fit_gpu_layers(model, n_ctx=256) == 0
    async with await lloyal.create_context(model, n_ctx=256) as ctx:
        assert ctx.n_gpu_layers == 0
    for given in (-1, 0, 7):
        async with await lloyal.create_context(model, n_ctx=256, n_gpu_layers=given) as ctx:
            assert ctx.n_gpu_layers == given


async def test_bad_gpu_layer_options_are_refused(model: Path) -> None:
    bad: list[tuple[dict[str, object], type[Exception]]] = [
        ({"n_gpu_layers": -2}, ValueError),
        ({"n_gpu_layers": "all"}, ValueError),
        ({"n_gpu_layers": 1.5}, TypeError),
        ({"fit_margin": -1}, ValueError),
        ({"fit_margin": "1G"}, TypeError),
    ]
    for kwargs, error in bad:
        with pytest.raises(error):
            await lloyal.create_context(model, n_ctx=256, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fit_margin"):
        lloyal.fit_gpu_layers(model, fit_margin=-1)
    with pytest.raises(FileNotFoundError):
        lloyal.fit_gpu_layers(model.with_name("missing.gguf"))


async def test_a_call_answered_at_once_needs_no_wake_up(
    smollm2: Path, anyio_backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A native call answered while it is made (greedy picks for a store:
    no sampler thread) is settled before it is awaited, with no round trip
    through the worker's wake-up; a decode, answered by the worker, still
    wakes the loop. Under asyncio the caller does not even yield; under
    trio no wake-up callback runs for it."""
    wakes: list[int] = []
    wake_all = _bridge._wake_all

    def counted(items: list[tuple[object, object]]) -> None:
        wakes.append(len(items))
        wake_all(items)  # type: ignore[arg-type]

    monkeypatch.setattr(_bridge, "_wake_all", counted)
    async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=3) as ctx:
        root = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await root.prefill(await ctx.tokenize("1, 2, 3, 4,"))
        kids = [await root.fork(), await root.fork()]
        store = lloyal.BranchStore(ctx)

        def probe() -> list[int]:
            """A callback the loop runs only if the caller yields."""
            ran: list[int] = []
            if anyio_backend_name != "trio":
                asyncio.get_running_loop().call_soon(ran.append, 1)
            return ran

        wakes.clear()
        ran = probe()
        picks = await store.produce(kids)
        assert (ran, wakes) == ([], [])
        ran = probe()
        await store.commit([(k, p.token) for k, p in zip(kids, picks, strict=True)])
        if anyio_backend_name == "trio":
            assert wakes, "the worker's answer wakes the run"
        else:
            assert ran, "the worker's answer is awaited"
        await root.prune_subtree()


def test_a_loop_without_add_reader_settles_a_ready_answer_at_once(smollm2: Path) -> None:
    async def main() -> list[int]:
        async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=2) as ctx:
            root = lloyal.Branch.create(ctx, lloyal.GREEDY)
            await root.prefill(await ctx.tokenize("1, 2, 3, 4,"))
            ran: list[int] = []
            asyncio.get_running_loop().call_soon(ran.append, 1)
            await lloyal.BranchStore(ctx).produce([root])
            seen = list(ran)
            await root.prune()
            return seen

    loop = _NoReaderLoop()
    try:
        assert loop.run_until_complete(main()) == []
    finally:
        loop.close()
