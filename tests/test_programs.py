"""lloyal.programs: gen / select / fork / join / run_batch against real models."""

from __future__ import annotations

import asyncio
import io
import json
import re
from pathlib import Path

import lloyal
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lloyal.programs import choice_logprobs

from tests.conftest import ROUTE_NOISE, route_distance

NO_EOS = {t: -100.0 for t in range(3)}
"""Bias keeping both test models off their end tokens (ids 1 and 2)."""

CHOICES = [" Paris", " London", " Berlin", " Madrid", " Rome", " Lisbon", " Vienna", " Paris!"]


def run(coro_fn, *args):  # type: ignore[no-untyped-def]
    return asyncio.run(coro_fn(*args))


@pytest.mark.deterministic_first
def test_select_scores_eight_choices_in_one_decode_as_scoring_each_alone(model: Path) -> None:
    """One decode for 8 choices (two share " Paris"), and on a deterministic
    context the same scores, bit for bit, as each choice decoded alone on a
    fork; the state goes on with the chosen text in its KV."""

    async def main() -> None:
        async with (
            await lloyal.create_context(model, n_ctx=512, n_seq_max=9, deterministic=True) as ctx,
            await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s,
        ):
            s += "The capital of France is"
            await s.flush()
            first = s.branch.logits.copy()
            alone = []
            for choice in CHOICES:
                tokens = ctx.tokenize_sync(choice, add_special=False)
                fork = await s.branch.fork(root=True)
                rows = await fork.prefill(tokens, logits="all")
                alone.append((choice_logprobs(first, rows, tokens), len(tokens)))
                await fork.prune()
            before = ctx.stats.decode_calls
            picked = await s.select("city", CHOICES)
            assert ctx.stats.decode_calls == before + 1
            assert s.scores["city"] == alone  # bit for bit
            means = [total / n for total, n in alone]
            assert picked == CHOICES[int(np.argmax(means))] == s["city"]
            assert s.text == "The capital of France is" + picked
            # The chosen path is what the branch holds, the others are gone.
            prompt = ctx.tokenize_sync("The capital of France is")
            assert s.branch.position == len(prompt) + alone[CHOICES.index(picked)][1]
            assert lloyal.BranchStore(ctx).available == ctx.n_seq_max - 1
            # Unnormalised: the sum decides.
            await s.select("raw", [" and", " a city", " the capital"], normalize=False)
            sums = [total for total, _ in s.scores["raw"]]
            assert s["raw"] == [" and", " a city", " the capital"][int(np.argmax(sums))]

    run(main)


def test_select_with_too_few_leases_scores_one_by_one(smollm2: Path) -> None:
    async def main() -> tuple[str, list[tuple[float, int]], str, list[tuple[float, int]]]:
        results = []
        for n_seq_max in (2, 9):
            async with (
                await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=n_seq_max) as ctx,
                await lloyal.ProgramState.open(ctx) as s,
            ):
                s += "The capital of France is"
                results.append((await s.select("city", CHOICES), s.scores["city"]))
        return results[0][0], results[0][1], results[1][0], results[1][1]

    few, few_scores, many, many_scores = run(main)
    assert few == many
    # Two routes (a tree in one decode, chains one by one): close, not bitwise.
    np.testing.assert_allclose(
        [t for t, _ in few_scores], [t for t, _ in many_scores], rtol=0, atol=0.5
    )


def test_forks_generating_together_cost_one_decode_per_step(model: Path) -> None:
    async def main() -> None:
        params = lloyal.GREEDY.with_(logit_bias=NO_EOS)
        async with (
            await lloyal.create_context(model, n_ctx=512, n_seq_max=5) as ctx,
            await lloyal.ProgramState.open(ctx, params=params) as s,
        ):
            s += "Once upon a time"
            forks = await s.fork(4)
            assert lloyal.BranchStore(ctx).available == 0
            before = ctx.stats.decode_calls
            texts = await asyncio.gather(*(f.gen("story", max_tokens=8) for f in forks))
            # 4 forks, one decode a step; the 8th token of each is chosen
            # and not decoded yet (nothing has needed it).
            assert ctx.stats.decode_calls == before + 7
            assert all(
                f["story"] == t and f.text.endswith(t) for f, t in zip(forks, texts, strict=True)
            )
            assert all(f.branch.position == forks[0].branch.position for f in forks)
            await asyncio.gather(*(f.flush() for f in forks))
            assert ctx.stats.decode_calls == before + 8
            await s.join(forks)
            assert all(f.closed for f in forks)
            assert forks[0]["story"] == texts[0]
            assert lloyal.BranchStore(ctx).available == 4
            assert "story" not in s  # a fork's captures are its own

    run(main)


@pytest.mark.deterministic_first
def test_a_generations_last_token_is_decoded_with_what_comes_next(smollm2: Path) -> None:
    """The last token of a generation is chosen, in the text and in the
    sampler's history, but decoded only with the next append (one decode
    for both), or never if the program ends; what follows sees the same
    logits either way (a deterministic context: the comparison with a
    plain prefill does not hang on how the decodes were split)."""

    async def main() -> None:
        async with await lloyal.create_context(
            smollm2, n_ctx=512, n_seq_max=2, deterministic=True
        ) as ctx:
            async with await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s:
                s += "Once upon a time"
                await s.flush()
                start = s.branch.position
                before = ctx.stats.decode_calls
                story = await s.gen("story", max_tokens=5)
                assert ctx.stats.decode_calls == before + 4
                assert s.branch.position == start + 4
                s += ". The end"
                before = ctx.stats.decode_calls
                after = await s.gen("after", max_tokens=3)
                assert ctx.stats.decode_calls == before + 3  # the append and 5th token: one
                assert (
                    s.branch.position
                    == start + 5 + len(ctx.tokenize_sync(". The end", add_special=False)) + 2
                )
            # The same text decoded as a prompt gives the same next tokens.
            b = lloyal.Branch.create(ctx, lloyal.GREEDY)
            await b.prefill(ctx.tokenize_sync("Once upon a time" + story + ". The end"))
            assert (await b.produce()).text == after[: len((await b.produce()).text)]
            await b.prune()

    run(main)


def test_a_generation_right_after_a_stop_string_goes_on_from_the_cut(smollm2: Path) -> None:
    """Whether the stop string cut the generation after some tokens or at
    its first, the branch is left with logits to go on from: a second
    generation needs no append in between."""

    async def main() -> None:
        async with (
            await lloyal.create_context(smollm2, n_ctx=512) as ctx,
            await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s,
        ):
            s += "1, 2, 3, 4,"
            a = await s.gen("a", max_tokens=8, stop=",")
            assert a == " 5"
            empty = await s.gen("b", max_tokens=8, stop=",")  # stops at once
            assert empty == ""
            again = await s.gen("c", max_tokens=1)
            assert again == ","
            assert s.text == "1, 2, 3, 4, 5,"

    run(main)


def test_stop_strings_are_cut_from_the_text_and_the_kv(smollm2: Path) -> None:
    """The stop string is neither captured nor kept in the KV: what the
    branch holds is the text up to it, so the next generation continues
    from there."""

    async def main() -> None:
        async with (
            await lloyal.create_context(smollm2, n_ctx=512) as ctx,
            await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s,
        ):
            s += "1, 2, 3, 4,"
            await s.flush()
            start = s.branch.position
            a = await s.gen("a", max_tokens=8, stop=",")
            assert a == " 5"
            assert s.text == "1, 2, 3, 4, 5"
            # The branch holds " 5" (its last token once flushed) and not
            # the comma after it.
            await s.flush()
            assert s.branch.position == start + len(ctx.tokenize_sync(a, add_special=False))
            s += ","
            b = await s.gen("b", max_tokens=8, stop=[",", "\n"])
            assert b == " 6"

    run(main)


def test_streamed_pieces_join_to_the_capture(model: Path) -> None:
    async def main() -> None:
        async with (
            await lloyal.create_context(model, n_ctx=512) as ctx,
            await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s,
        ):
            s += "Once upon a time"
            pieces = [p async for p in s.gen_stream("story", max_tokens=12, stop=".")]
            assert "".join(pieces) == s["story"]
            assert "." not in s["story"]

    run(main)


def test_regex_and_json_schema_constrain_one_generation(model: Path) -> None:
    async def main() -> None:
        async with (
            await lloyal.create_context(model, n_ctx=512) as ctx,
            await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s,
        ):
            s += "A three-digit number:"
            number = await s.gen("n", regex=r" [0-9]{3}", max_tokens=8)
            assert re.fullmatch(r" [0-9]{3}", number)
            s += "\nAs JSON:"
            schema = {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
                "required": ["n"],
                "additionalProperties": False,
            }
            data = json.loads(await s.gen("json", json_schema=schema, max_tokens=48))
            assert isinstance(data["n"], int)
            # The grammar was for that generation only.
            free = await s.gen("free", max_tokens=4)
            assert isinstance(free, str)

    run(main)


def test_chat_turns_are_the_template_text(model: Path) -> None:
    """Turns appended one by one give the text the template renders for the
    whole chat, with an assistant turn generated in the middle."""

    async def main() -> None:
        async with await lloyal.create_context(model, n_ctx=1024) as ctx:
            # The Gemma 3 test model's GGUF has no template: the built-in one.
            template = None if ctx.chat_template else "gemma"
            async with await lloyal.ProgramState.open(
                ctx, params=lloyal.GREEDY, chat_template=template
            ) as s:
                s += lloyal.system("Answer with one word.")
                s += lloyal.user("What colour is the sky?")
                s += lloyal.assistant()
                opened = ctx.format_chat(s.messages, template=template).prompt
                assert s.text == opened
                answer = await s.gen("answer", max_tokens=6)
                s += lloyal.user("And grass?")
                messages = [
                    {"role": "system", "content": "Answer with one word."},
                    {"role": "user", "content": "What colour is the sky?"},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "And grass?"},
                ]
                assert s.messages == messages
                rendered = ctx.format_chat(messages, add_generation_prompt=False, template=template)
                assert s.text == rendered.prompt
                s += lloyal.assistant()
                assert await s.gen("again", max_tokens=6)

    run(main)


# A template that rewrites earlier text as turns are added: only the last
# message is marked, so every new turn changes the one before it.
_MARK_LAST = (
    "{% for m in messages %}{% if loop.last %}>> {% endif %}"
    "{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_a_rewriting_template_is_synced_as_a_session_syncs(model: Path) -> None:
    """A turn whose template rewrites earlier text re-renders the chat, as
    a Session does: the text is the template's render of the messages,
    and the branch keeps the tokens it shares with it and re-decodes from
    the first changed one (the same KV as decoding the text afresh)."""

    async def main() -> None:
        async with await lloyal.create_context(model, n_ctx=1024, n_seq_max=2) as ctx:
            s = await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY, chat_template=_MARK_LAST)
            s += "Preamble. "  # before the chat: kept as it is
            s += lloyal.user("What colour is the sky?")
            s += lloyal.assistant()
            await s.gen("answer", max_tokens=4)
            s += lloyal.user("And grass?")
            rendered = ctx.format_chat(
                s.messages, add_generation_prompt=False, template=_MARK_LAST
            ).prompt
            assert s.text == "Preamble. " + rendered
            held = s.branch.position
            decoded = ctx.stats.tokens_decoded
            await s.flush()
            fresh = await ctx.tokenize(s.text)
            assert s.branch.position == len(fresh)
            # Only the tail from the first changed token was decoded again.
            assert 0 < ctx.stats.tokens_decoded - decoded < len(fresh)
            assert s.branch.position - held < len(fresh)
            again = lloyal.Branch.create(ctx, lloyal.GREEDY)
            await again.prefill(fresh)
            assert route_distance(again.logits, s.branch.logits) <= ROUTE_NOISE
            await again.prune()
            s += lloyal.assistant()
            assert await s.gen("again", max_tokens=3)
            await s.close()

    run(main)


def test_a_rewriting_template_after_text_of_its_own_is_refused(smollm2: Path) -> None:
    async def main() -> None:
        async with await lloyal.create_context(smollm2, n_ctx=512) as ctx:
            s = await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY, chat_template=_MARK_LAST)
            s += lloyal.user("Hi")
            s += "a note of the program's own\n"
            text, messages = s.text, s.messages
            with pytest.raises(ValueError, match="rewrites earlier text"):
                s += lloyal.user("Again")
            assert (s.text, s.messages) == (text, messages)
            await s.flush()
            assert await s.select("x", [" yes", " no"])
            await s.close()

    run(main)


@pytest.mark.deterministic_first
def test_run_batch_returns_what_running_one_by_one_returns(smollm2: Path) -> None:
    @lloyal.program
    async def continue_count(s: lloyal.ProgramState, start: int) -> str:
        s += ", ".join(str(start + i) for i in range(4)) + ","
        await s.gen("next", max_tokens=6, stop=",")
        return str(s["next"]).strip()

    async def main() -> None:
        async with await lloyal.create_context(
            smollm2, n_ctx=1024, n_seq_max=4, deterministic=True
        ) as ctx:
            inputs = [1, 7, 20, 33, 41, 58]
            alone = [
                (await continue_count.run(ctx, i, params=lloyal.GREEDY)).result for i in inputs
            ]
            report = io.StringIO()
            before = ctx.stats.decode_calls
            states = await continue_count.run_batch(
                ctx, inputs, params=lloyal.GREEDY, concurrency=3, progress=report
            )
            assert [s.result for s in states] == alone
            assert all(s.closed for s in states)
            assert report.getvalue().rstrip().endswith("6/6")
            # Three at a time share decodes: fewer decodes than one by one.
            assert ctx.stats.decode_calls - before < 6 * 3
            assert lloyal.BranchStore(ctx).available == 4

    run(main)


def test_bad_input_is_refused_and_leaves_the_state_usable(smollm2: Path) -> None:
    async def main() -> None:
        async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=2) as ctx:
            s = await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY)
            s += "The capital of France is"
            with pytest.raises(TypeError):
                s += 5  # type: ignore[operator]
            with pytest.raises(ValueError, match="not both"):
                await s.gen(regex="a", json_schema={"type": "string"})
            with pytest.raises(ValueError, match="stop"):
                await s.gen(stop="")
            with pytest.raises(ValueError, match="max_tokens"):
                await s.gen(max_tokens=0)
            with pytest.raises(ValueError, match="choices"):
                await s.select("x", [])
            with pytest.raises(ValueError, match="empty"):
                await s.select("x", [" Paris", ""])
            with pytest.raises(ValueError, match="n must be"):
                await s.fork(0)
            with pytest.raises(lloyal.NoLeaseError):
                await s.fork(2)
            with pytest.raises(lloyal.GrammarError):
                await s.gen(regex="(")
            # Refused with per-call sampling: the state's sampling stays.
            before = s.branch.sampler_params
            for refused in ({"regex": "("}, {"regex": "a\\"}, {"json_schema": {"type": "x"}}):
                with pytest.raises((lloyal.GrammarError, ValueError)):
                    await s.gen(temperature=0.9, top_p=0.5, **refused)  # type: ignore[arg-type]
                assert s.branch.sampler_params == before, refused
            assert s.text == "The capital of France is"
            assert await s.select("city", [" Paris", " London"]) == " Paris"
            await s.close()
            with pytest.raises(lloyal.StateError):
                await s.gen("late")
            with pytest.raises(lloyal.StateError):
                s += "more"
            assert s["city"] == " Paris"
            with pytest.raises(TypeError):
                await lloyal.run_batch(lambda s: None, ctx, [1])  # type: ignore[arg-type]

    run(main)


def test_a_stream_closed_early_keeps_what_was_generated(smollm2: Path) -> None:
    async def main() -> None:
        async with (
            await lloyal.create_context(smollm2, n_ctx=512) as ctx,
            await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY) as s,
        ):
            s += "Once upon a time"
            await s.flush()
            start = s.branch.position
            stream = s.gen_stream("story", max_tokens=20)
            first = await stream.__anext__()
            await stream.aclose()
            assert s["story"] == first
            assert s.text == "Once upon a time" + first
            assert s.branch.position == start + 1  # one token, and it is in the text
            assert await s.gen("more", max_tokens=3)

    run(main)


def test_a_failing_program_in_a_batch_raises_its_own_error(smollm2: Path) -> None:
    """The others finish and give their leases back; the error is the
    program's own (not a task group's wrapper)."""

    @lloyal.program
    async def picky(s: lloyal.ProgramState, n: int) -> str:
        s += f"{n}, {n + 1},"
        out = await s.gen("next", max_tokens=3, stop=",")
        if n == 2:
            raise KeyError("two")
        return out

    async def main() -> None:
        async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=4) as ctx:
            with pytest.raises(KeyError, match="two"):
                await picky.run_batch(ctx, [1, 2, 3, 4], params=lloyal.GREEDY)
            assert lloyal.BranchStore(ctx).available == 4

    run(main)


def test_forks_a_program_leaves_open_are_closed_with_it(smollm2: Path) -> None:
    """A program that forks and never joins gives every lease back when it
    ends (its forks used to hold theirs until collected, and starved the
    other programs of a batch)."""

    @lloyal.program
    async def leaky(s: lloyal.ProgramState, word: str) -> str:
        s += f"Say {word}:"
        forks = await s.fork(2)
        return forks[0].text

    async def main() -> None:
        async with await lloyal.create_context(smollm2, n_ctx=512, n_seq_max=3) as ctx:
            states = await lloyal.run_batch(leaky, ctx, ["a", "b", "c"], concurrency=1)
            assert [s.result for s in states] == ["Say a:", "Say b:", "Say c:"]
            assert lloyal.BranchStore(ctx).available == 3

    run(main)


_REGEXES = [None, "[0-9]{1,3}", "(yes|no)", ".{0,4}", "(", "a\\", "[z-a]", "a{2,1}", "\\p{Zz}"]
_SCHEMAS = [
    None,
    {"type": "string", "maxLength": 4},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    True,
    False,
    {"type": "nothing"},
    {"enum": []},
    {"$ref": "#/missing"},
    "not json",
]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    calls=st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "max_tokens": st.sampled_from([1, 3, 0, -1, "2", 2.5]),
                "stop": st.sampled_from([None, "", ".", ["a", "b"], [""], 5]),
                "regex": st.sampled_from(_REGEXES),
                "json_schema": st.sampled_from(_SCHEMAS),
                "temperature": st.sampled_from([None, 0, 0.7, 2.0, -1.0, float("nan"), "x"]),
                "top_p": st.sampled_from([None, 0.5, 1.0, 1.5, -0.1]),
            },
        ),
        min_size=4,
        max_size=10,
    )
)
def test_random_gen_calls_generate_or_are_refused_and_change_nothing(
    smollm2: Path, calls: list[dict[str, object]]
) -> None:
    """Random ``gen`` calls on one program state (issue 48's fuzz of
    program calls): each generates at most ``max_tokens`` tokens and
    appends its text, or is refused with a typed error and leaves the
    text and the state's sampling as they were; the state works after."""

    async def main() -> None:
        async with await lloyal.create_context(smollm2, n_ctx=1024, n_seq_max=2) as ctx:
            s = await lloyal.ProgramState.open(ctx, params=lloyal.GREEDY)
            s += "Answer:"
            for call in calls:
                text, params = s.text, s.branch.sampler_params
                try:
                    got = await s.gen(**call)  # type: ignore[arg-type]
                except (ValueError, TypeError, lloyal.LloyalError):
                    assert s.text == text, call
                    assert s.branch.sampler_params == params, call
                    continue
                assert s.text == text + got, call
                assert s.branch.sampler_params == params, call
            assert isinstance(await s.gen(max_tokens=2), str)
            await s.close()

    run(main)
