"""LoRA adapters and control vectors on both test models, with adapter
files written by ``lloyal.fixtures`` (random weights of the models' shapes).

Contexts are deterministic (``deterministic=True``): a branch's logits are
then the same bits however it is batched, so "the same as the base model"
and "the same as alone" are exact comparisons.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import lloyal
import numpy as np
import pytest
from lloyal import fixtures

# deterministic_first: this module's contexts are deterministic (see
# tests/doctest_model.py).
pytestmark = [pytest.mark.anyio, pytest.mark.deterministic_first]

PROMPT = "The capital of France is"


@pytest.fixture
def anyio_backend() -> str:
    # Adapters are engine work: one event loop is enough (the batching
    # under each loop is tested in test_store.py).
    return "asyncio"


@pytest.fixture
async def ctx(model: Path) -> AsyncIterator[lloyal.Context]:
    async with await lloyal.create_context(model, n_ctx=512, n_seq_max=4, deterministic=True) as c:
        yield c


async def logits_under(
    ctx: lloyal.Context, prompt: list[int], *args: object, **kw: object
) -> np.ndarray:
    """The last logits of ``prompt`` on a new branch under the given set."""
    async with lloyal.Branch.create(ctx) as b:
        b.set_adapters(*args, **kw)  # type: ignore[arg-type]
        await b.prefill(prompt)
        return b.logits.copy()


async def test_a_lora_changes_logits_as_its_weights_and_scale_say(
    ctx: lloyal.Context, model_name: str
) -> None:
    prompt = await ctx.tokenize(PROMPT)
    zero = await ctx.load_lora(fixtures.lora("zero", model_name))
    rand = await ctx.load_lora(fixtures.lora("random", model_name))
    assert rand.alpha == fixtures.ALPHA
    assert rand.n_pairs == 2 * ctx.model_info.n_layer
    assert await ctx.load_lora(fixtures.lora("random", model_name)) == rand
    base = await logits_under(ctx, prompt)
    assert np.array_equal(await logits_under(ctx, prompt, zero), base), "B = 0 is the base"
    assert np.array_equal(await logits_under(ctx, prompt, {rand: 0.0}), base), "scale 0"
    changed = await logits_under(ctx, prompt, [rand])
    assert np.abs(changed - base).max() > 0.1
    halfway = await logits_under(ctx, prompt, [(rand, 0.5)])
    assert not np.array_equal(halfway, changed)
    assert not np.array_equal(halfway, base)
    assert np.array_equal(await logits_under(ctx, prompt, {zero: 1.0, rand: 1.0}), changed)
    assert np.array_equal(await logits_under(ctx, prompt), base), "back to the base"


async def test_branches_with_different_sets_share_a_commit_and_each_gets_what_it_gets_alone(
    ctx: lloyal.Context, model_name: str
) -> None:
    prompt = await ctx.tokenize(PROMPT)
    rand = await ctx.load_lora(fixtures.lora("random", model_name))

    async def greedy(lora: lloyal.Lora | None, n: int = 4) -> list[int]:
        async with lloyal.Branch.create(ctx, lloyal.GREEDY) as b:
            b.set_adapters(lora)
            await b.prefill(prompt)
            out = []
            for _ in range(n):
                out.append((await b.produce()).token)
                await b.commit(out[-1])
            return out

    alone = {None: await greedy(None), rand: await greedy(rand)}
    store = lloyal.BranchStore(ctx)
    plain, tuned = (
        lloyal.Branch.create(ctx, lloyal.GREEDY),
        lloyal.Branch.create(ctx, lloyal.GREEDY),
    )
    tuned.set_adapters(rand)
    await store.prefill([(plain, prompt), (tuned, prompt)])
    twin = await tuned.fork()
    assert twin.adapters == tuned.adapters
    assert plain.adapters == lloyal.Adapters()
    got: dict[str, list[int]] = {"plain": [], "tuned": [], "twin": []}
    for _ in range(4):
        before = ctx.stats.decode_calls
        picks = {
            k: (await b.produce()).token
            for k, b in [("plain", plain), ("tuned", tuned), ("twin", twin)]
        }
        for k, t in picks.items():
            got[k].append(t)
        await store.commit(
            [(plain, picks["plain"]), (tuned, picks["tuned"]), (twin, picks["twin"])]
        )
        # One decode per set: the tuned branch and its fork share theirs.
        assert ctx.stats.decode_calls - before == 2
    assert got["plain"] == alone[None]
    assert got["tuned"] == got["twin"] == alone[rand]
    assert alone[None] != alone[rand]
    for b in (plain, twin, tuned):
        await b.prune()


async def test_the_default_set_is_what_new_branches_and_the_flat_api_start_with(
    ctx: lloyal.Context, model_name: str
) -> None:
    prompt = await ctx.tokenize(PROMPT)
    rand = await ctx.load_lora(fixtures.lora("random", model_name))
    base = await logits_under(ctx, prompt)
    older = lloyal.Branch.create(ctx)
    ctx.set_adapters({rand: 1.0})
    assert ctx.adapters == lloyal.Adapters(((rand, 1.0),))
    async with lloyal.Branch.create(ctx) as b:
        assert b.adapters == ctx.adapters
        assert older.adapters == lloyal.Adapters()
        await b.prefill(prompt)
        tuned = b.logits.copy()
    assert np.abs(tuned - base).max() > 0.1
    await older.prune()  # every lease free: the flat API may use sequence 0
    await ctx.decode(prompt, 0, seq_id=0)
    assert np.array_equal(ctx.get_logits(), tuned), "the flat API decodes under the default"
    ctx.set_adapters()
    assert ctx.adapters == lloyal.Adapters()


async def test_a_control_vector_from_an_array_or_a_file(
    ctx: lloyal.Context, model_name: str
) -> None:
    prompt = await ctx.tokenize(PROMPT)
    info = ctx.model_info
    base = await logits_under(ctx, prompt)
    cv = ctx.load_control_vector(fixtures.control_vector(model_name))
    assert cv.layers == (1, info.n_layer - 1)
    steered = await logits_under(ctx, prompt, control_vector=cv)
    assert np.abs(steered - base).max() > 0.1
    zero = ctx.control_vector(np.zeros((info.n_layer, info.n_embd), np.float32))
    assert np.array_equal(await logits_under(ctx, prompt, control_vector=zero), base)
    weak = ctx.load_control_vector(fixtures.control_vector(model_name), scale=0.0)
    assert np.array_equal(await logits_under(ctx, prompt, control_vector=weak), base)
    few = ctx.load_control_vector(fixtures.control_vector(model_name), layers=(2, 3))
    assert few.layers == (2, 3)
    assert not np.array_equal(await logits_under(ctx, prompt, control_vector=few), steered)
    with pytest.raises(ValueError, match="rows"):
        ctx.control_vector(np.zeros((2, info.n_embd), np.float32))
    with pytest.raises(ValueError, match="row 0"):
        ctx.control_vector(np.ones((info.n_layer, info.n_embd), np.float32))
    with pytest.raises(ValueError, match="layers"):
        ctx.load_control_vector(fixtures.control_vector(model_name), layers=(0, 2))


async def test_bad_adapters_raise_typed_errors_and_change_nothing(
    ctx: lloyal.Context, model: Path, model_name: str, tmp_path: Path
) -> None:
    prompt = await ctx.tokenize(PROMPT)
    base = await logits_under(ctx, prompt)
    other = "gemma3" if model_name == "smollm2" else "smollm2"
    with pytest.raises(FileNotFoundError):
        await ctx.load_lora(tmp_path / "missing.gguf")
    with pytest.raises(lloyal.AdapterLoadError, match="not an adapter"):
        await ctx.load_lora(model)
    with pytest.raises(lloyal.AdapterLoadError, match="adapts a"):
        await ctx.load_lora(fixtures.lora("random", other))
    cut = tmp_path / "cut.gguf"
    data = fixtures.lora("random", model_name).read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(lloyal.AdapterLoadError, match="truncated"):
        await ctx.load_lora(cut)
    (tmp_path / "text.gguf").write_text("not a GGUF file")
    with pytest.raises(lloyal.AdapterLoadError, match="GGUF"):
        await ctx.load_lora(tmp_path / "text.gguf")
    with pytest.raises(lloyal.AdapterLoadError, match="made for a"):
        ctx.load_control_vector(fixtures.control_vector(other))
    shutil.copy(fixtures.lora("random", model_name), tmp_path / "copy.gguf")
    with pytest.raises(lloyal.AdapterLoadError, match='not "controlvector"'):
        ctx.load_control_vector(tmp_path / "copy.gguf")

    rand = await ctx.load_lora(fixtures.lora("random", model_name))
    async with lloyal.Branch.create(ctx) as b:
        for bad, error in [
            ("adapter.gguf", TypeError),
            ([(rand, "1")], TypeError),
            ([(rand, float("nan"))], ValueError),
            ([rand, rand], ValueError),
        ]:
            with pytest.raises(error):
                b.set_adapters(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            b.set_adapters(control_vector="cv.gguf")  # type: ignore[arg-type]
        assert b.adapters == lloyal.Adapters()
    async with await lloyal.create_context(model, n_ctx=256) as elsewhere:
        foreign = await elsewhere.load_lora(fixtures.lora("random", model_name))
        with pytest.raises(ValueError, match="another context"):
            ctx.set_adapters(foreign)
    assert np.array_equal(await logits_under(ctx, prompt), base)


async def test_the_prefix_cache_reuses_a_prompt_only_under_its_own_set(
    ctx: lloyal.Context, model_name: str
) -> None:
    prompt = await ctx.tokenize("A long shared system prompt. " * 4)
    rand = await ctx.load_lora(fixtures.lora("random", model_name))
    tuned = lloyal.Adapters(((rand, 1.0),))
    alone = await logits_under(ctx, prompt, rand)
    cache = lloyal.PrefixCache(ctx, max_branches=3)
    b = await cache.branch(prompt)
    await b.prune()
    assert cache.match(prompt) == len(prompt)
    assert cache.match(prompt, adapters=tuned) == 0, "base KV is no prefix under the LoRA"
    b = await cache.branch(prompt, adapters=tuned)
    assert b.adapters == tuned
    assert np.array_equal(b.logits, alone)
    await b.prune()
    assert cache.match(prompt, adapters=tuned) == len(prompt)
    b = await cache.branch([*prompt, 13], adapters=tuned)
    assert b.adapters == tuned
    assert cache.stats.saved_tokens == len(prompt)
    await b.prune()
    # A scale that float32 rounds, and an adapter at scale 0, find the
    # entries made under the set as the branch holds it.
    odd = lloyal.Adapters(((rand, 0.3),))
    b = await cache.branch(prompt, adapters=odd)
    await b.prune()
    assert cache.match(prompt, adapters=odd) == len(prompt)
    zero = lloyal.Adapters(((rand, 0.0),))  # the base set
    assert cache.match(prompt, adapters=zero) == cache.match(prompt)
    await cache.aclose()
