"""Grammar-constrained decoding: JSON schemas, GBNF, Lark, handles, branches.

These tests are about grammars, not event loops, and some sample dozens of
documents: their async tests run once, on asyncio (pytest-asyncio's
``@pytest.mark.asyncio``), where the suites marked ``anyio`` run every test
under asyncio, uvloop and trio.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import lloyal
import numpy as np
import pytest
from lloyal.models import model_path

from tests.conftest import MODELS, open_sync

SCHEMAS: dict[str, dict[str, Any]] = {
    "strings": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "city": {"type": "string", "maxLength": 12},
        },
        "required": ["name", "city"],
        "additionalProperties": False,
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            # multipleOf bounds the decimals: without it a small model can
            # extend a valid number forever ("0.12121212..."). 0.25 is exact
            # in binary, so jsonschema's float check has no rounding trouble.
            "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 4,
    },
    "nested_optional": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 6},
                        "maxItems": 2,
                    },
                },
                "required": ["id"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"ok": {"const": True}},
                "required": ["ok"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"error": {"type": "string", "maxLength": 10}},
                "required": ["error"],
                "additionalProperties": False,
            },
        ]
    },
}


@pytest.fixture(scope="module", params=MODELS)
def ctx(request: pytest.FixtureRequest) -> Iterator[lloyal.Context]:
    ctx = open_sync(model_path(request.param), n_ctx=4096, n_seq_max=24)
    yield ctx
    ctx.close()


async def sample_many(
    ctx: lloyal.Context,
    *,
    n: int,
    prompt: str,
    max_tokens: int = 96,
    **grammar: Any,
) -> list[str]:
    """n sampled completions under one grammar, decoded in lockstep."""
    params = lloyal.SamplingParams(temperature=0.9, top_k=40, seed=7)
    root = lloyal.Branch.create(ctx, params, **grammar)
    await root.prefill(await ctx.tokenize(prompt))
    store = lloyal.BranchStore(ctx)
    kids = []
    for i in range(n):
        kid = await root.fork()
        kid.reseed_sampler(1000 + i)
        kids.append(kid)
    tokens: list[list[int]] = [[] for _ in kids]
    live = list(range(n))
    for _ in range(max_tokens):
        step = []
        for i in live:
            p = await kids[i].produce()
            if not p.is_stop:
                tokens[i].append(p.token)
                step.append((kids[i], p.token))
        live = [i for i in live if kids[i] in {b for b, _ in step}]
        if not step:
            break
        await store.commit(step)
    await root.prune_subtree()
    assert not live, "some generations did not finish"
    return [await ctx.detokenize(t) for t in tokens]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.asyncio
async def test_json_schema_generations_all_validate(ctx: lloyal.Context, name: str) -> None:
    schema = SCHEMAS[name]
    prompt = f"Write one JSON value for the schema {json.dumps(schema)}.\nJSON: "
    texts = await sample_many(ctx, n=20, prompt=prompt, json_schema=schema)
    assert len(texts) == 20
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    # Sampling, not one greedy answer copied 20 times.
    assert len(set(texts)) > 1 or name == "enum"


@pytest.mark.asyncio
async def test_gbnf_from_json_schema_to_grammar_constrains(ctx: lloyal.Context) -> None:
    # llama.cpp's converter bounds integers but not floats: use integers.
    schema = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "pet": {"enum": ["cat", "dog"]},
        },
        "required": ["age", "pet"],
        "additionalProperties": False,
    }
    gbnf = lloyal.json_schema_to_grammar(schema)
    assert "root ::=" in gbnf
    texts = await sample_many(ctx, n=4, prompt="A person as JSON: ", grammar=gbnf)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.asyncio
async def test_lark_grammar_constrains(ctx: lloyal.Context) -> None:
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/\n'
    texts = await sample_many(ctx, n=4, prompt="Q: 6 times 7?\nA: ", lark=lark)
    for text in texts:
        assert text.startswith("The answer is ")
        assert text.endswith(".")
        assert text[len("The answer is ") : -1].isdigit()


@pytest.mark.asyncio
async def test_grammar_branching_at_a_choice_point(ctx: lloyal.Context) -> None:
    """Generate to the enum value, fork three ways, force each value."""
    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "why": {"type": "string", "maxLength": 20},
        },
        "required": ["color", "why"],
        "additionalProperties": False,
    }

    root = lloyal.Branch.create(ctx, lloyal.GREEDY, json_schema=schema)
    await root.prefill(await ctx.tokenize("Favourite color as JSON: "))
    prefix: list[int] = []
    # Up to the opening quote of the value: the grammar then allows
    # exactly the enum's spellings.
    while not (await ctx.detokenize(prefix)).endswith('"color": "'):
        p = await root.produce()
        await root.commit(p.token)
        prefix.append(p.token)
        assert len(prefix) < 20
    texts = []
    for value in ["red", "green", "blue"]:
        child = await root.fork()
        forced = await ctx.tokenize(value, add_special=False)
        for t in forced:
            await child.commit(t)
        rest = [tok.token async for tok in child]
        texts.append(await ctx.detokenize(prefix + forced + rest))
        await child.prune()
    await root.prune()

    for value, text in zip(["red", "green", "blue"], texts, strict=True):
        doc = json.loads(text)
        jsonschema.validate(doc, schema)
        assert doc["color"] == value


@pytest.mark.asyncio
async def test_forbidden_token_raises_and_changes_nothing(ctx: lloyal.Context) -> None:
    b = lloyal.Branch.create(ctx, lloyal.GREEDY, grammar='root ::= "yes" | "no"')
    await b.prefill(await ctx.tokenize("Answer: "))
    position, ppl = b.position, b.perplexity
    bad = (await ctx.tokenize("maybe", add_special=False))[0]
    with pytest.raises(lloyal.GrammarError, match="not allowed"):
        await b.commit(bad)
    with pytest.raises(lloyal.GrammarError):
        b.accept(bad)
    assert (b.position, b.perplexity) == (position, ppl)
    assert b.grammar_accepting is False
    # A stop token is forbidden until the grammar accepts.
    with pytest.raises(lloyal.GrammarError):
        await b.commit(ctx.eog_token)
    text = "".join([t.text async for t in b])
    assert text in ("yes", "no")
    assert b.grammar_accepting is True
    await b.prune()


@pytest.mark.asyncio
async def test_fork_clones_grammar_state_and_set_grammar_swaps(ctx: lloyal.Context) -> None:
    root = lloyal.Branch.create(ctx, lloyal.GREEDY, grammar='root ::= "ab" | "cd"')
    await root.prefill(await ctx.tokenize("Letters: "))
    a = (await ctx.tokenize("a", add_special=False))[0]
    await root.commit(a)
    child = await root.fork()
    assert child.has_grammar
    # The child continues the parent's grammar: after "a" only "b".
    rest = "".join([t.text async for t in child])
    assert rest == "b"
    # Swapping the parent's grammar does not touch existing children.
    root.set_grammar(lark='start: "!"')
    p = await root.produce()
    assert p.text == "!"
    root.set_grammar()
    assert not root.has_grammar
    assert root.grammar_accepting is None
    await root.prune_subtree()


def test_handle_api(ctx: lloyal.Context) -> None:
    g = ctx.create_grammar(json_schema={"type": "boolean"})
    tok = {w: ctx.tokenize_sync(w, add_special=False)[0] for w in ("true", "false", "7")}
    logits = np.zeros(ctx.vocab_size, dtype=np.float32)
    g.apply(logits)
    assert logits[tok["7"]] == -np.inf
    assert np.isfinite(logits).sum() >= 2
    assert not g.allows(ctx.eog_token)
    assert not g.is_accepting
    twin = g.clone()
    for t in ctx.tokenize_sync("true", add_special=False):
        g.accept(t)
    assert g.is_accepting
    assert g.allows(ctx.eog_token)
    assert not twin.is_accepting  # the clone kept its own state
    with pytest.raises(lloyal.GrammarError):
        g.accept(tok["7"])
    assert g.is_accepting  # a refused token changes nothing
    g.reset()
    assert not g.is_accepting
    assert g.allows(tok["false"])
    with pytest.raises(TypeError):
        g.apply(np.zeros(ctx.vocab_size, dtype=np.float64))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="vocabulary"):
        g.apply(np.zeros(3, dtype=np.float32))
    readonly = np.zeros(ctx.vocab_size, dtype=np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        g.apply(readonly)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"grammar": "root ::= missing"},
        {"grammar": "root ::= <think>"},
        {"grammar": 'root ::= "unterminated'},
        {"lark": "start: undefined_rule"},
        {"json_schema": "{not json"},
        {"json_schema": {"type": "no-such-type"}},
        {"json_schema": {"type": "string", "minLength": 5, "maxLength": 2}},
    ],
)
def test_invalid_grammars_raise_at_creation(ctx: lloyal.Context, kwargs: dict[str, Any]) -> None:
    store = lloyal.BranchStore(ctx)
    available = store.available
    with pytest.raises(lloyal.GrammarError):
        ctx.create_grammar(**kwargs)
    with pytest.raises(lloyal.GrammarError):
        lloyal.Branch.create(ctx, **kwargs)
    assert store.available == available  # no lease taken


def test_argument_errors(ctx: lloyal.Context) -> None:
    with pytest.raises(ValueError, match="at most one"):
        ctx.create_grammar('root ::= "a"', lark='start: "a"')
    with pytest.raises(ValueError, match="give one of"):
        ctx.create_grammar()
    with pytest.raises(TypeError):
        ctx.create_grammar(42)  # type: ignore[arg-type]
    with pytest.raises(lloyal.GrammarError):
        lloyal.json_schema_to_grammar("{oops")
