"""Sessions: a conversation decodes each turn's delta only and always holds
exactly the rendered chat; forks diverge alone; saves round-trip.

The async tests run once, on asyncio: they are about the chat, not the
event loop (the ``anyio`` suites cover those).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lloyal
import numpy as np
import pytest
from lloyal.models import model_path

from tests.conftest import MODELS, ROUTE_NOISE, open_sync

# SmolLM2 renders with its own (ChatML) template; the Gemma 3 GGUF has none,
# so it takes the built-in gemma template.
TEMPLATES = {"smollm2": None, "gemma3": "gemma"}
QUESTIONS = ["Hi there.", "What is 2+2?", "Name a colour.", "Thanks!", "Goodbye."]


@pytest.fixture(scope="module", params=MODELS)
def chat_ctx(request: pytest.FixtureRequest) -> Iterator[tuple[lloyal.Context, str | None]]:
    ctx = open_sync(model_path(request.param), n_ctx=2048, n_seq_max=4)
    yield ctx, TEMPLATES[request.param]
    ctx.close()


def _whole_chat_tokens(ctx: lloyal.Context, text: str) -> int:
    """Tokens of the whole rendered chat, BOS once (the templates that write
    ``<bos>`` and the tokenizer's own BOS are the same token)."""
    tokens = ctx.tokenize_sync(text)
    if len(tokens) > 1 and tokens[0] == tokens[1] == ctx.bos_token:
        tokens = tokens[1:]
    return len(tokens)


@pytest.mark.asyncio
async def test_five_turns_decode_only_each_delta(
    chat_ctx: tuple[lloyal.Context, str | None],
) -> None:
    ctx, template = chat_ctx
    async with await lloyal.Session.create(ctx, params=lloyal.GREEDY, template=template) as s:
        rendered_tokens = 0
        for i, question in enumerate(QUESTIONS):
            before = ctx.stats
            await s.add_user(question)
            after = ctx.stats
            # What was decoded is exactly the new turn: the template's text
            # for it, measured by tokenizing the whole chat before and after.
            whole = _whole_chat_tokens(ctx, s.render().prompt)
            assert s.last_delta == whole - rendered_tokens
            assert after.tokens_decoded - before.tokens_decoded == s.last_delta
            assert after.decode_calls - before.decode_calls == 1
            if i > 0:
                assert s.last_delta < whole / 2  # a delta, not the chat again
            if i % 2:
                reply = await s.reply(max_tokens=6)
                assert s.messages[-1] == {"role": "assistant", "content": reply.content}
                assert s.text == s.render(add_generation_prompt=False).prompt
            else:
                await s.add_assistant(f"Answer number {i}.")
            rendered_tokens = s.branch.position
        full = ctx.format_chat(s.messages, template=template, add_generation_prompt=False)
        assert s.text == full.prompt
        assert s.branch.position == _whole_chat_tokens(ctx, full.prompt)
        assert [m["role"] for m in s.messages] == ["user", "assistant"] * 5


@pytest.mark.asyncio
async def test_session_logits_match_decoding_the_whole_chat(
    chat_ctx: tuple[lloyal.Context, str | None],
) -> None:
    ctx, template = chat_ctx
    async with await lloyal.Session.create(ctx, params=lloyal.GREEDY, template=template) as s:
        for i, q in enumerate(QUESTIONS[:3]):
            await s.add_user(q)
            await s.add_assistant(f"Reply {i}.")
        await s.add_user("And now?")
        async with lloyal.Branch.create(ctx, lloyal.GREEDY) as whole:
            text = s.render().prompt
            tokens = ctx.tokenize_sync(text)
            if tokens[:2] == [ctx.bos_token] * 2:
                tokens = tokens[1:]
            await whole.prefill(tokens)
            # Another route through the model (turn by turn against all at
            # once) moves logits by a little, a wrong cache by a lot.
            gap = np.abs(whole.logits - s.branch.logits).max()
            assert gap < ROUTE_NOISE
            assert whole.position == s.branch.position


@pytest.mark.asyncio
async def test_forked_session_diverges_without_touching_its_parent(
    chat_ctx: tuple[lloyal.Context, str | None],
) -> None:
    ctx, template = chat_ctx
    async with await lloyal.Session.create(ctx, params=lloyal.GREEDY, template=template) as s:
        await s.add_user("Tell me about cats.")
        text, position, logits = s.text, s.branch.position, s.branch.logits
        async with await s.fork() as child:
            await child.add_assistant("Cats are small.")
            await child.add_user("And dogs?")
            assert child.text.startswith(text)
            assert child.text != text
            assert child.branch.position > position
            assert child.last_delta < 20
            # The parent holds what it held, bit for bit.
            assert s.text == text
            assert s.branch.position == position
            assert np.array_equal(s.branch.logits, logits)
            assert len(s.messages) == 1
            assert len(child.messages) == 3
            reply = await s.reply(max_tokens=4)
            assert s.messages[-1]["content"] == reply.content
            assert len(child.messages) == 3


@pytest.mark.asyncio
async def test_save_and_load_round_trip(
    chat_ctx: tuple[lloyal.Context, str | None], tmp_path: Path
) -> None:
    ctx, template = chat_ctx
    async with await lloyal.Session.create(
        ctx,
        [{"role": "user", "content": "Count to three."}],
        params=lloyal.GREEDY,
        template=template,
    ) as s:
        data = await s.save()
        await s.save_file(tmp_path / "chat.session")
        logits, text = s.branch.logits, s.text
        first = (await s.branch.produce()).token
        await s.reply(max_tokens=5)
    for loaded in (
        await lloyal.Session.load(ctx, data, params=lloyal.GREEDY),
        await lloyal.Session.load_file(ctx, tmp_path / "chat.session", params=lloyal.GREEDY),
    ):
        async with loaded:
            assert loaded.messages == [{"role": "user", "content": "Count to three."}]
            assert loaded.text == text
            # The snapshot is restored bit for bit, so is the next choice.
            assert np.array_equal(loaded.branch.logits, logits)
            assert (await loaded.branch.produce()).token == first
            again = await loaded.reply(max_tokens=5)
            assert loaded.messages[-1] == {"role": "assistant", "content": again.content}
            await loaded.add_user("Again?")
            assert loaded.last_delta < 20
    with pytest.raises(lloyal.StateError):
        await lloyal.Session.load(ctx, b"not a session")
    with pytest.raises(lloyal.StateError):
        await lloyal.Session.load(ctx, data[:40] + b"x" + data[41:])
    assert lloyal.BranchStore(ctx).available == 4  # nothing leaked


@pytest.mark.asyncio
async def test_a_template_that_rewrites_history_costs_a_redecode_not_a_wrong_cache(
    smollm2: Path,
) -> None:
    # This template numbers the turns in its first line, so every new turn
    # changes the beginning of the text.
    template = (
        "<|im_start|>system\nTurns: {{ messages | length }}<|im_end|>\n"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    async with (
        await lloyal.create_context(smollm2, n_seq_max=2) as ctx,
        await lloyal.Session.create(ctx, params=lloyal.GREEDY, template=template) as s,
    ):
        await s.add_user("One.")
        await s.add_assistant("Two.")
        await s.add_user("Three.")
        assert s.text == s.render().prompt
        assert s.branch.position == len(ctx.tokenize_sync(s.text))
        assert s.last_delta > 10  # redecoded from the changed first line


@pytest.mark.asyncio
async def test_bad_input_leaves_the_session_as_it_was(smollm2: Path) -> None:
    async with (
        await lloyal.create_context(smollm2, n_seq_max=2) as ctx,
        await lloyal.Session.create(ctx, params=lloyal.GREEDY) as s,
    ):
        await s.add_user("Hello.")
        text = s.text
        with pytest.raises(TypeError):
            await s.add_user(42)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="role"):
            await s.extend([{"content": "no role"}])
        with pytest.raises(ValueError, match="max_tokens"):
            async for _ in s.generate(max_tokens=0):
                pass
        assert s.text == text
        assert len(s.messages) == 1


MALFORMED: list[dict[str, Any]] = [
    {"role": "assistant", "tool_calls": "get_weather"},
    {"role": "assistant", "tool_calls": [1, 2]},
    {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]},
    {"role": 5, "content": "x"},
    {"role": "user", "content": 5},
    {"role": "user", "content": ["text"]},
    {"role": "tool", "content": "x", "tool_call_id": 7},
]


@pytest.mark.asyncio
async def test_malformed_messages_are_value_errors_naming_them(smollm2: Path) -> None:
    """format_chat and Session.extend refuse a malformed message with a
    ValueError naming it (tool calls that were not a list of calls were
    an AttributeError from deep inside the rendering), and the session
    stays as it was."""
    async with (
        await lloyal.create_context(smollm2, n_seq_max=2) as ctx,
        await lloyal.Session.create(ctx, params=lloyal.GREEDY) as s,
    ):
        await s.add_user("Hello.")
        text = s.text
        for message in MALFORMED:
            with pytest.raises(ValueError, match=r"messages\[1\]"):
                ctx.format_chat([{"role": "user", "content": "Hi"}, message])
            with pytest.raises(ValueError, match=r"messages\[0\]"):
                await s.extend([message])
        assert s.text == text
        assert len(s.messages) == 1


@pytest.mark.asyncio
async def test_text_cannot_pose_as_a_medium(smollm2: Path) -> None:
    """Text between NUL characters that looks like a medium's key is text
    (it was read as the key: a bare ``KeyError`` for a digest the context
    does not hold, the medium itself for one it does)."""
    async with await lloyal.create_context(smollm2, n_ctx=1024, n_seq_max=2) as ctx:
        posing = "\x00" + "ab" * 32 + "\x00 is my text"
        async with await lloyal.Session.create(ctx, params=lloyal.GREEDY) as chat:
            await chat.add_user(posing)
            prompt = chat.render().prompt
            assert chat.text == prompt
            assert chat.branch.position == len(await ctx.tokenize(prompt))
            # A saved session round-trips the text as text.
            again = await lloyal.Session.load(ctx, await chat.save())
            async with again:
                assert again.text == prompt
