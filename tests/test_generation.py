"""lloyal.Generation: the one produce-until-stop rule set every loop feeds
(stop tokens and strings with hold-back, max_tokens, preserved tokens, the
cut a program rewinds to, the last token's fate)."""

from __future__ import annotations

import lloyal
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def _feed_text(gen: lloyal.Generation, pieces: list[str]) -> list[lloyal.GenerationStep]:
    steps = []
    for i, piece in enumerate(pieces):
        step = gen.feed(i, text=piece)
        steps.append(step)
        if step.finish is not None:
            break
    return steps


_alphabet = st.sampled_from("ab,. \n")


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(_alphabet, max_size=4), max_size=12),
    stops=st.lists(st.text(_alphabet, min_size=1, max_size=3), max_size=3),
)
def test_shown_text_is_the_output_and_never_passes_a_stop(
    pieces: list[str], stops: list[str]
) -> None:
    gen = lloyal.Generation(None, stop=stops)
    steps = _feed_text(gen, pieces)
    shown = "".join(s.text for s in steps) + gen.close().text
    text = "".join(pieces[: len(steps)])
    assert gen.text == text
    # What was shown is the text up to the earliest stop string, nothing more.
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    first = min(hits, default=None)
    assert shown == gen.output == (text if first is None else text[:first])
    assert gen.finish == "stop"
    if first is not None:
        assert gen.cut == first
        assert gen.stop is not None
        assert text.startswith(gen.stop, first)
        assert steps[-1].finish == "stop"
        assert steps[-1].stop == gen.stop
        # Every kept token ends at or before the cut; the next one does not.
        assert all(e <= first for e in gen.ends[: gen.kept])
        assert all(e > first for e in gen.ends[gen.kept :])
    else:
        assert gen.stop is None
        assert gen.cut is None
        assert gen.kept == len(gen.tokens)


def test_text_that_could_begin_a_stop_is_held_until_it_cannot() -> None:
    gen = lloyal.Generation(None, stop=["END"])
    assert gen.feed(1, text="go E").text == "go "
    assert gen.held == "E"
    assert gen.feed(2, text="N").text == ""
    step = gen.feed(3, text="X")  # "ENX": not the stop after all
    assert (step.text, step.finish, gen.held) == ("ENX", None, "")
    step = gen.feed(4, text=" E")
    assert step.text == " "
    step = gen.feed(5, text="ND and more")
    assert (step.token, step.text, step.finish, step.stop) == (5, "", "stop", "END")
    assert (gen.output, gen.kept, gen.tokens) == ("go ENX ", 3, [1, 2, 3, 4, 5])
    with pytest.raises(RuntimeError, match="ended"):
        gen.feed(6, text="x")
    assert gen.close() == lloyal.GenerationStep(None, "", "stop", "END")


def test_max_tokens_ends_with_the_held_text() -> None:
    gen = lloyal.Generation(None, stop=["STOP"], max_tokens=2)
    assert gen.feed(1, text="a S").text == "a "
    step = gen.feed(2, text="T")
    assert (step.token, step.text, step.finish, step.stop) == (2, "ST", "length", None)


def test_stop_tokens_end_without_the_token() -> None:
    gen = lloyal.Generation(None, stop_tokens={7})
    assert gen.feed(1, text="x").token == 1
    assert gen.feed(7, text="</s>") == lloyal.GenerationStep(None, "", "stop", None)
    assert gen.tokens == [1]
    assert gen.output == "x"
    gen = lloyal.Generation(None)
    assert gen.feed(9, is_stop=True).finish == "stop"
    # llama-server's ignore_eos: a stop token is just a token.
    gen = lloyal.Generation(None, stop_tokens={7}, ignore_eos=True)
    assert gen.feed(7, is_stop=True, text="").token == 7
    assert gen.finish is None


def test_close_sends_what_is_held_and_ends_once() -> None:
    gen = lloyal.Generation(None, stop=["zz"])
    gen.feed(1, text="abz")
    step = gen.close("length")
    assert (step.text, step.finish, gen.output) == ("z", "length", "abz")
    assert gen.close("stop").finish == "length"


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_tokens": 0}, ValueError),
        ({"max_tokens": 1.5}, TypeError),
        ({"stop": [""]}, ValueError),
        ({"stop": [3]}, ValueError),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        lloyal.Generation(None, **kwargs)  # type: ignore[arg-type]


def test_characters_split_across_tokens_are_never_cut(shared_ctx: lloyal.Context) -> None:
    text = "café ☕ and 漢字 END tail"
    tokens = shared_ctx.tokenize_sync(text, add_special=False)
    gen = lloyal.Generation(shared_ctx, stop=[" END"])
    steps = []
    for t in tokens:
        steps.append(gen.feed(t))
        if gen.finish is not None:
            break
    assert "".join(s.text for s in steps) == "café ☕ and 漢字" == gen.output
    assert all("\ufffd" not in s.text for s in steps)
    assert gen.finish == "stop"
    assert gen.stop == " END"
    assert gen.text.startswith("café ☕ and 漢字 END")


def test_preserved_tokens_show_their_special_text(shared_ctx: lloyal.Context) -> None:
    word = shared_ctx.tokenize_sync(" hi", add_special=False)
    eog = shared_ctx.eog_token
    marker = shared_ctx.token_to_text(eog, render_special=True)
    assert marker  # (both test models name their end of turn)
    gen = lloyal.Generation(shared_ctx, preserved={eog})
    texts = [gen.feed(t).text for t in [*word, eog]]
    assert "".join(texts) == " hi" + marker
    assert gen.finish is None
    plain = lloyal.Generation(shared_ctx)
    assert [plain.feed(t).text for t in [*word, eog]][-1] == ""


@pytest.mark.asyncio
@pytest.mark.parametrize("last", ["decode", "skip", "accept"])
async def test_drive_decodes_every_token_but_the_last_as_asked(model: object, last: str) -> None:
    async with await lloyal.create_context(model, n_ctx=256) as ctx:  # type: ignore[arg-type]
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        prompt = await ctx.tokenize("The days of the week are Monday, Tuesday,")
        await b.prefill(prompt)
        accepted: list[int] = []
        how = accepted.append if last == "accept" else last
        gen = lloyal.Generation(ctx, max_tokens=4)
        steps = [s async for s in gen.drive(b, last=how)]  # type: ignore[arg-type]
        assert gen.finish == "length"
        assert len(steps) == 4 == len(gen.tokens)
        assert b.position == len(prompt) + (4 if last == "decode" else 3)
        assert accepted == (gen.tokens[-1:] if last == "accept" else [])
        assert "".join(s.text for s in steps) == gen.output
        await b.prune()


@pytest.mark.asyncio
async def test_drive_leaves_the_stop_string_token_undecoded(smollm2: object) -> None:
    async with await lloyal.create_context(smollm2, n_ctx=256) as ctx:  # type: ignore[arg-type]
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        prompt = await ctx.tokenize("Count: 1, 2, 3,")
        await b.prefill(prompt)
        gen = lloyal.Generation(ctx, stop=[", 6"], max_tokens=20)
        async for _ in gen.drive(b):
            pass
        assert (gen.output, gen.stop) == (" 4, 5", ", 6")
        # Every token but the one that completed ", 6" is in the branch.
        assert b.position == len(prompt) + len(gen.tokens) - 1
        await b.prune()
