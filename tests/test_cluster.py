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
import time
from collections.abc import Iterator
from typing import Any

# Imported before Ray starts its threads: hypothesis's pytest plugin imports
# it lazily at the end of the session otherwise, and on CPython 3.11.7 an
# ast.parse racing Ray's background threads failed with "AST constructor
# recursion depth mismatch" (the ast module's shared depth counter).
import hypothesis  # noqa: F401
import lloyal
import pytest

if sys.platform == "win32":  # make test-windows: docs/windows.md
    pytest.skip(
        "Windows: Ray is not installed under Wine; lloyal.cluster is untested on Windows",
        allow_module_level=True,
    )
import ray
from lloyal.cluster import (
    ContextPool,
    RemoteBranch,
    WorkerLostError,
    beam_search,
    best_of_n,
    mcts,
)
from lloyal.models import model_path
from lloyal.strategies import TreeNode

from tests._hang import HANG_GUARD_S, deadline
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
LOCAL = """
import asyncio, json, sys
import lloyal
from lloyal.strategies import beam_search, best_of_n, mcts

def tree(n):
    return [n.token, n.visits, n.value, [tree(c) for c in n.children]]

async def main():
    options = {**json.loads(sys.argv[2]), "n_seq_max": 16}
    async with await lloyal.create_context(sys.argv[1], **options) as ctx:
        b = await best_of_n(ctx, "Once upon a time", n=3, max_tokens=6, seed=3)
        s = await beam_search(ctx, "Once upon a time", width=3, max_tokens=8)
        m = await mcts(ctx, "My favourite colour is", lambda t: t.count("e") - 0.1 * len(t),
                       iterations=6, width=2, rollout_tokens=5, seed=4)
    print(json.dumps({
        "best_of_n": {"tokens": [list(c.tokens) for c in b.candidates], "best": b.best_index,
                      "text": b.output.text},
        "beam_search": {"beams": [list(c.tokens) for c in s.beams], "scores": s.scores,
                        "text": s.text},
        "mcts": {"text": m.text, "score": m.score, "tree": [tree(c) for c in m.roots],
                 "rollouts": m.rollouts},
    }))

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def local(pool: ContextPool) -> dict[str, Any]:
    """The local strategies' results for the remote tests to equal."""
    path = str(model_path(pool.model_name))  # type: ignore[attr-defined]
    run = subprocess.run(
        [sys.executable, "-c", LOCAL, path, json.dumps(OPTIONS)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    out: dict[str, Any] = json.loads(run.stdout)
    return out


def test_remote_best_of_n_equals_the_local_one(pool: ContextPool, local: dict[str, Any]) -> None:
    remote = asyncio.run(best_of_n(pool, "Once upon a time", n=3, max_tokens=6, seed=3))
    want = local["best_of_n"]
    assert [list(c.tokens) for c in remote.candidates] == want["tokens"]
    assert remote.best_index == want["best"]
    assert remote.output.text == want["text"]


def test_remote_beam_search_equals_the_local_one(pool: ContextPool, local: dict[str, Any]) -> None:
    want = local["beam_search"]
    for spread in (True, False):
        before = pool.migrations
        remote = asyncio.run(
            beam_search(pool, "Once upon a time", width=3, max_tokens=8, spread=spread)
        )
        assert [list(c.tokens) for c in remote.beams] == want["beams"]
        assert list(remote.scores) == want["scores"]  # the same bits
        assert remote.text == want["text"]
        assert remote.migrations == pool.migrations - before
        assert remote.lost == 0
        assert remote.peak_leases <= 2 * 3
        if spread:
            # Three beams over two workers: some children were made on the
            # other worker from their parent's state bytes.
            assert remote.migrations > 0
        else:
            assert remote.migrations == 0


def _tree(n: TreeNode) -> list[Any]:
    return [n.token, n.visits, n.value, [_tree(c) for c in n.children]]


def test_remote_mcts_equals_the_local_one(pool: ContextPool, local: dict[str, Any]) -> None:
    remote = asyncio.run(
        mcts(
            pool,
            "My favourite colour is",
            lambda t: t.count("e") - 0.1 * len(t),
            iterations=6,
            width=2,
            rollout_tokens=5,
            seed=4,
        )
    )
    want = local["mcts"]
    assert remote.text == want["text"]
    assert remote.score == want["score"]
    assert remote.rollouts == want["rollouts"]
    # The same tree: tokens, visits and mean scores node for node.
    assert [_tree(c) for c in remote.roots] == want["tree"]
    assert remote.lost == 0


def test_parallel_mcts_spreads_its_iterations(pool: ContextPool) -> None:
    async def run() -> None:
        trips = [w.round_trips for w in pool.workers]
        result = await mcts(
            pool,
            "My favourite colour is",
            lambda t: -len(t),
            iterations=6,
            width=2,
            rollout_tokens=4,
            parallel=2,
        )
        assert result.iterations == 6
        assert result.rollouts >= 2
        assert result.score == -len(result.text)
        # The first level went round robin: both workers did work.
        assert all(w.round_trips > t for w, t in zip(pool.workers, trips, strict=True))
        # Every branch was given back (only prefix-cache entries remain).
        for w in pool.workers:
            assert (await w.load())["branches"] == 0

    asyncio.run(run())


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


def test_a_fork_its_worker_has_no_lease_for_is_made_on_another(pool: ContextPool) -> None:
    async def run() -> None:
        a, b = pool.workers
        tokens = await a.call("tokenize", "The capital of France is")
        root = await pool.branch(tokens, params=lloyal.GREEDY, worker=a)
        before = pool.migrations
        free = (await a.load())["free"]  # leases free and prefix-cache entries
        kids = await root.fork_many([None] * (free + 2))
        assert [k.worker for k in kids] == [a] * free + [b, b]
        assert pool.migrations == before + 2
        # The spilled children are exact copies: greedy, they go on alike.
        outs = await asyncio.gather(*(_generate(k, 4) for k in (kids[0], kids[-1])))
        assert outs[0] == outs[1]
        assert len(outs[0]) == 4
        for k in [*kids, root]:
            await k.prune()
        assert (await a.load())["branches"] == (await b.load())["branches"] == 0

    asyncio.run(run())


def test_a_cancelled_fork_leaves_no_branch_behind(pool: ContextPool) -> None:
    """The actor makes the children anyway; the client prunes them as soon
    as its answer comes back to nobody."""

    async def run() -> None:
        w = pool.workers[0]
        tokens = await w.call("tokenize", "The capital of France is")
        root = await pool.branch(tokens, params=lloyal.GREEDY, worker=w)
        before = await w.load()
        # Meant to expire, not a hang guard: the answer (a round trip to
        # the actor) cannot come back in 0.1 ms, the slower the surer.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(root.fork_many([None] * 3), timeout=0.0001)
        give_up = deadline()  # a hang guard (a starved machine is slow, not wrong)
        while True:
            load = await w.load()
            done = load["made"] == before["made"] + 3 and load["branches"] == before["branches"]
            if done or time.monotonic() > give_up:
                break
            await asyncio.sleep(0.01)
        assert load["made"] == before["made"] + 3  # the actor made them
        assert load["branches"] == before["branches"]  # and they were pruned
        await root.prune()

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


def test_calls_made_while_a_step_is_on_the_wire_go_in_the_next(pool: ContextPool) -> None:
    """Tasks out of step with each other: what one queues while another's
    step is in flight is sent when that step returns (once this hung)."""

    async def run() -> None:
        w = pool.workers[0]
        tokens = await w.call("tokenize", "Count with me: one, two,")
        root = await pool.branch(tokens, params=lloyal.GREEDY, worker=w)
        kids = await root.fork_many([None] * 3)

        async def late(k: RemoteBranch, delay: float) -> list[int]:
            await asyncio.sleep(delay)
            return await _generate(k, 6)

        # A hang guard, not a speed limit: this once hung.
        outs = await asyncio.wait_for(
            asyncio.gather(*(late(k, i * 0.003) for i, k in enumerate(kids))),
            timeout=HANG_GUARD_S,
        )
        assert outs[0] == outs[1] == outs[2]  # greedy: the same tokens whatever the timing
        assert len(outs[0]) == 6
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
        with pytest.raises(ValueError, match="free KV leases"):
            await mcts(pool, tokens, len, iterations=100)
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
        params = lloyal.SamplingParams(temperature=0.8, logit_bias=NO_EOS)

        killer = asyncio.create_task(_kill_when(doomed, start + 4))
        result = await best_of_n(pool, "Once upon a time", n=4, max_tokens=48, params=params)
        await killer
        # Candidates go round robin: 1 and 3 were on the worker that died.
        assert result.lost == (1, 3)
        assert result.best_index in (0, 2)
        assert len(result.candidates[0].tokens) == 48
        assert 0 < len(result.candidates[1].tokens) < 48
        assert pool.replaced >= 1

    asyncio.run(run())


def test_beam_search_goes_on_with_the_beams_it_still_holds(pool: ContextPool) -> None:
    async def run() -> None:
        doomed = pool.workers[1]
        start = (await doomed.call("stats"))["decode_calls"]
        replaced = pool.replaced
        killer = asyncio.create_task(_kill_when(doomed, start + 4))
        prompt = await pool.workers[0].call("tokenize", "Once upon a time")
        result = await beam_search(pool, prompt, width=4, max_tokens=40)
        await killer
        assert result.lost > 0  # the beams on the dead worker
        assert pool.replaced == replaced + 1
        # The search went on (onto the replacement too) to the end.
        assert len(result.beams) == 4
        assert max(len(c.tokens) for c in result.beams) > 8

    asyncio.run(run())


def test_mcts_goes_on_without_a_dead_workers_subtree(pool: ContextPool) -> None:
    async def run() -> None:
        doomed = pool.workers[1]
        start = (await doomed.call("stats"))["decode_calls"]
        params = lloyal.SamplingParams(temperature=0.8, logit_bias=NO_EOS)
        # The first level goes round robin: child 1 and its rollout (47
        # decodes) are on the worker that dies during them.
        killer = asyncio.create_task(_kill_when(doomed, start + 6))
        result = await mcts(
            pool,
            "Once upon a time",
            lambda t: -len(t),
            iterations=3,
            width=2,
            rollout_tokens=48,
            params=params,
        )
        await killer
        assert result.lost >= 1
        assert result.rollouts >= 1
        assert result.score == -len(result.text)
        for w in pool.workers:
            assert (await w.load())["branches"] == 0

    asyncio.run(run())


@pytest.fixture(scope="module", params=MODELS)
def small_pool(cluster: None, request: pytest.FixtureRequest) -> Iterator[ContextPool]:
    """Two workers with 256 KV cells each."""
    options = {**OPTIONS, "n_ctx": 256}
    pool = asyncio.run(ContextPool.start(model_path(request.param), workers=2, **options))
    yield pool
    asyncio.run(pool.aclose())


def test_a_commit_its_worker_has_no_cells_for_moves_the_branch(small_pool: ContextPool) -> None:
    async def run() -> None:
        a, b = small_pool.workers
        cells = (await a.load())["cells_free"]
        text = "A long story about the sea and the ships that sail on it. " * 40
        prompt = (await a.call("tokenize", text))[:40]
        other = "Numbers, one after another: 7, 19, 23, 42, 56, 71, 88, 93. " * 40
        filler = (await a.call("tokenize", other))[: cells - 40 - 4]  # shares no cells
        runner = await small_pool.branch(prompt, params=lloyal.GREEDY, worker=a)
        full = await small_pool.branch(filler, params=lloyal.GREEDY, worker=a)
        # The reference: the same prompt on the other worker, with room.
        reference = await small_pool.branch(prompt, params=lloyal.GREEDY, worker=b)
        want = await _generate(reference, 12)
        await reference.prune()
        before = small_pool.migrations
        got = await _generate(runner, 12)  # a's cache fills a few tokens in
        assert runner.worker is b
        assert small_pool.migrations == before + 1
        assert got == want
        assert runner.position == len(prompt) + 12
        for x in (runner, full):
            await x.prune()

    asyncio.run(run())


def test_a_program_runs_unchanged_on_the_pool(pool: ContextPool) -> None:
    """The same lloyal program runs on a pool: sent to a worker, run next to
    its context; run_batch spreads programs over the workers and returns
    what running them one by one returns (deterministic workers)."""

    @lloyal.program
    async def capital(s: lloyal.ProgramState, country: str) -> str:
        s += f"The capital of {country} is"
        await s.select("city", [" Paris", " Berlin", " Madrid", " Rome"])
        s += "."
        await s.gen("more", max_tokens=6)
        return str(s["city"])

    async def run() -> None:
        one = await capital.run(pool, "France", params=lloyal.GREEDY)
        assert one.closed
        assert one.result == one["city"]
        assert one.text.startswith("The capital of France is" + one["city"] + ".")
        countries = ["France", "Germany", "Spain", "Italy", "Greece", "Peru"]
        alone = [(await capital.run(pool, c, params=lloyal.GREEDY)).text for c in countries]
        before = [(await w.call("stats"))["decode_calls"] for w in pool.workers]
        states = await capital.run_batch(pool, countries, params=lloyal.GREEDY)
        after = [(await w.call("stats"))["decode_calls"] for w in pool.workers]
        assert [s.text for s in states] == alone
        assert all(a > b for a, b in zip(after, before, strict=True))  # both workers ran some
        for w in pool.workers:
            assert (await w.load())["branches"] == 0

    asyncio.run(run())


NO_EOS = {t: -100.0 for t in range(3)}
"""Bias keeping both test models off their end tokens (ids 1 and 2)."""


async def _kill_when(worker: Any, decodes: int) -> None:
    """Kill ``worker``'s actor once it has made ``decodes`` decodes (or at
    the hang guard, tests/_hang.py: the test then fails on what it sees).

    Not a race against the clock: the callers kill a few decodes into runs
    of 40-48 decodes, and each poll is one round trip to the actor, which
    answers between its decodes, so the poll falls dozens of decodes short
    of the end on a machine of any speed or load."""
    give_up = deadline()
    while time.monotonic() < give_up:
        if (await worker.call("stats"))["decode_calls"] >= decodes:
            break
        await asyncio.sleep(0.01)
    ray.kill(worker.handle)


def _live_actors() -> int:
    # Ray's own table of actors (its public state API needs the dashboard,
    # which these tests do not start).
    from ray._private import state

    return sum(1 for a in state.actors().values() if a["State"] != "DEAD")


@pytest.mark.parametrize(
    ("path", "options", "error"),
    [
        ("/nonexistent/model.gguf", OPTIONS, FileNotFoundError),
        (None, {**OPTIONS, "n_ctx": 0}, ValueError),
    ],
)
def test_a_pool_that_fails_to_start_leaves_no_actor_running(
    cluster: None, path: str | None, options: dict[str, Any], error: type[Exception]
) -> None:
    before = _live_actors()
    model = path if path is not None else str(model_path("smollm2"))
    with pytest.raises(error):
        asyncio.run(ContextPool.start(model, workers=2, **options))
    # ray.kill is asynchronous: wait for the actors to be reported dead (a
    # hang guard, not a speed limit).
    give_up = deadline()
    while _live_actors() > before and time.monotonic() < give_up:
        time.sleep(0.2)
    assert _live_actors() == before


def test_the_old_name_of_pool_worker_still_works_with_a_warning() -> None:
    import lloyal.cluster

    with pytest.warns(DeprecationWarning, match="PoolWorker"):
        old = lloyal.cluster.Worker  # type: ignore[attr-defined]
    assert old is lloyal.cluster.PoolWorker
