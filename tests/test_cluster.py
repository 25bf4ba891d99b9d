"""lloyal.cluster on a local Ray cluster: two actors, small contexts.

The contexts are ``deterministic=True``: the same logits bits whatever the
batch, so a branch on another process, in another batch, draws exactly
what it would have drawn here.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator

# Imported before Ray starts its threads: hypothesis's pytest plugin imports
# it lazily at the end of the session otherwise, and on CPython 3.11.7 an
# ast.parse racing Ray's background threads failed with "AST constructor
# recursion depth mismatch" (the ast module's shared depth counter).
import hypothesis  # noqa: F401
import lloyal
import pytest
import ray
from lloyal.cluster import ContextPool, RemoteBranch, WorkerLostError, best_of_n
from lloyal.models import model_path

from tests.conftest import MODELS

OPTIONS = {"n_seq_max": 8, "n_ctx": 2048, "n_threads": 1, "deterministic": True}


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module", params=MODELS)
def pool(cluster: None, request: pytest.FixtureRequest) -> Iterator[ContextPool]:
    pool = asyncio.run(ContextPool.start(model_path(request.param), workers=2, **OPTIONS))
    pool.model_name = request.param  # type: ignore[attr-defined]
    yield pool
    asyncio.run(pool.aclose())


async def _generate(branch: RemoteBranch, n: int) -> list[int]:
    out = []
    for _ in range(n):
        p = await branch.produce()
        if p.is_stop:
            break
        await branch.commit(p.token)
        out.append(p.token)
    return out


# The local run happens in a fresh interpreter: a deterministic context
# must be set up before its process decodes anything (docs/determinism.md),
# and this one has decoded long before.
LOCAL_BEST_OF_N = """
import asyncio, json, sys
import lloyal
from lloyal.strategies import best_of_n

async def main():
    async with await lloyal.create_context(sys.argv[1], **json.loads(sys.argv[2])) as ctx:
        r = await best_of_n(ctx, "Once upon a time", n=3, max_tokens=6, seed=3)
    print(json.dumps({"tokens": [list(c.tokens) for c in r.candidates], "best": r.best_index,
                      "text": r.output.text}))

asyncio.run(main())
"""


def test_remote_best_of_n_equals_the_local_one(pool: ContextPool) -> None:
    remote = asyncio.run(best_of_n(pool, "Once upon a time", n=3, max_tokens=6, seed=3))
    path = str(model_path(pool.model_name))  # type: ignore[attr-defined]
    run = subprocess.run(
        [sys.executable, "-c", LOCAL_BEST_OF_N, path, json.dumps(OPTIONS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    local = json.loads(run.stdout)
    assert [list(c.tokens) for c in remote.candidates] == local["tokens"]
    assert remote.best_index == local["best"]
    assert remote.output.text == local["text"]


def test_a_migrated_branch_continues_exactly(pool: ContextPool) -> None:
    async def run() -> None:
        a, b = pool.workers
        tokens = await a.call("tokenize", "The capital of France is")
        for params in (lloyal.GREEDY, lloyal.SamplingParams(temperature=1.0, seed=9)):
            root = await pool.branch(tokens, params=params, worker=a)
            await _generate(root, 2)  # the random stream moves on first
            stay, move = await root.fork_many([None, None])
            await move.migrate(b)
            assert move.worker is b
            assert move.position == stay.position
            assert await _generate(move, 8) == await _generate(stay, 8)
            for x in (stay, move, root):
                await x.prune()

    asyncio.run(run())


def test_prefix_placement_sends_a_shared_prompt_to_the_same_worker(pool: ContextPool) -> None:
    async def run() -> None:
        w = pool.workers[0]
        prefix = await w.call("tokenize", "Background facts about rivers and seas. " * 30)
        assert len(prefix) >= 200
        q1 = await w.call("tokenize", " First question?", False)
        q2 = await w.call("tokenize", " Second question?", False)
        first = await pool.branch(prefix + q1)
        second = await pool.branch(prefix + q2)
        assert second.worker is first.worker
        # Only the second prompt's own suffix was decoded there.
        assert second.decoded <= len(q2)
        # (The first decoded the prefix, less at most the BOS token an
        # earlier test's prompt left cached.)
        assert first.decoded >= len(prefix) + len(q1) - 1
        await first.prune()
        await second.prune()

    asyncio.run(run())


def test_calls_from_many_tasks_share_round_trips_and_decodes(pool: ContextPool) -> None:
    async def run() -> None:
        w = pool.workers[1]
        tokens = await w.call("tokenize", "Count with me: one, two,")
        root = await pool.branch(tokens, params=lloyal.GREEDY, worker=w)
        kids = await root.fork_many([None] * 6)
        trips, decodes = w.round_trips, (await w.call("stats"))["decode_calls"]
        await asyncio.gather(*(_generate(k, 5) for k in kids))
        steps_trips = w.round_trips - trips - 1  # less the stats call
        steps_decodes = (await w.call("stats"))["decode_calls"] - decodes
        # 6 branches x 5 tokens: one produce and one commit round trip per
        # step for all six, one decode per step.
        assert steps_trips <= 2 * 5 + 1
        assert steps_decodes == 5
        for k in [*kids, root]:
            await k.prune()

    asyncio.run(run())


def test_bad_input_raises_the_local_exception_and_harms_nothing(pool: ContextPool) -> None:
    async def run() -> None:
        w = pool.workers[0]
        with pytest.raises(ValueError, match="token"):
            await pool.branch([10**9], worker=w)
        tokens = await w.call("tokenize", "The capital of France is")
        b = await pool.branch(tokens, params=lloyal.GREEDY, worker=w)
        other = await b.fork()
        # In one tick with a good commit: only the bad one fails.
        bad, good = await asyncio.gather(
            b.commit(-5), other.commit(tokens[-1]), return_exceptions=True
        )
        assert isinstance(bad, ValueError)
        assert "vocabulary" in str(bad)
        assert good is None
        assert other.position == len(tokens) + 1
        assert len(await _generate(b, 2)) == 2  # the branch is intact
        await other.prune()
        await b.prune()

    asyncio.run(run())


def test_a_dead_worker_fails_its_branches_and_is_replaced(pool: ContextPool) -> None:
    async def run() -> None:
        a, b = pool.workers
        tokens = await a.call("tokenize", "Hello there")
        doomed = await pool.branch(tokens, params=lloyal.GREEDY, worker=a)
        safe = await pool.branch(tokens, params=lloyal.GREEDY, worker=b)
        old_pid = a.pid
        ray.kill(a.handle)
        with pytest.raises(WorkerLostError):
            await _generate(doomed, 3)
        with pytest.raises(WorkerLostError):  # fails fast from now on
            await doomed.produce()
        await doomed.prune()  # nothing to free: no error
        assert pool.replaced >= 1
        assert a.pid != old_pid
        # The replacement works, and the other worker never noticed.
        fresh = await pool.branch(tokens, params=lloyal.GREEDY, worker=a)
        assert len(await _generate(fresh, 3)) == 3
        assert len(await _generate(safe, 3)) == 3
        await fresh.prune()
        await safe.prune()

    asyncio.run(run())


def test_best_of_n_goes_on_with_the_candidates_it_still_holds(pool: ContextPool) -> None:
    async def run() -> None:
        doomed = pool.workers[1]
        start = (await doomed.call("stats"))["decode_calls"]
        params = lloyal.SamplingParams(temperature=0.8, logit_bias={t: -100.0 for t in range(3)})

        async def kill_after_a_few_steps() -> None:
            for _ in range(3000):  # a few steps in (30 s at the most)
                if (await doomed.call("stats"))["decode_calls"] >= start + 4:
                    break
                await asyncio.sleep(0.01)
            ray.kill(doomed.handle)

        killer = asyncio.create_task(kill_after_a_few_steps())
        result = await best_of_n(pool, "Once upon a time", n=4, max_tokens=48, params=params)
        await killer
        # Candidates go round robin: 1 and 3 were on the worker that died.
        assert result.lost == (1, 3)
        assert result.best_index in (0, 2)
        assert len(result.candidates[0].tokens) == 48
        assert 0 < len(result.candidates[1].tokens) < 48
        assert pool.replaced >= 1

    asyncio.run(run())
