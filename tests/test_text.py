"""Tokenizer, detokenizer, streaming text and chat templates."""

from __future__ import annotations

import asyncio

import lloyal
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Printable text: letters, digits, punctuation, symbols and spaces from all
# of Unicode (no control characters or lone surrogates, which no tokenizer
# promises to round-trip). U+2581 is left out too: it is SentencePiece's own
# word-boundary mark, so Gemma's vocabulary reads it back as a space (as
# llama.cpp and the original tokenizer do); hypothesis found it once.
_printable = st.characters(
    codec="utf-8",
    categories=("L", "M", "N", "P", "S", "Zs"),
    exclude_characters="\u00a0\u2581",
)


def _roundtrip(ctx: lloyal.Context, text: str) -> str:
    tokens = ctx.tokenize_sync(text, add_special=False, parse_special=False)
    return asyncio.run(ctx.detokenize(tokens))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(
        alphabet=st.characters(codec="ascii", categories=("L", "N", "P", "S", "Zs")), max_size=80
    )
)
def test_ascii_round_trip(shared_ctx: lloyal.Context, text: str) -> None:
    assert _roundtrip(shared_ctx, text) == text


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(alphabet=_printable, max_size=40))
def test_unicode_round_trip(shared_ctx: lloyal.Context, text: str) -> None:
    assert _roundtrip(shared_ctx, text) == text


def test_known_strings_round_trip(shared_ctx: lloyal.Context) -> None:
    for text in ["Hello, world!", "naïve café — 東京 🚀", "  leading and trailing  ", "a\nb\tc"]:
        assert _roundtrip(shared_ctx, text) == text


def test_add_special_follows_model_bos(shared_ctx: lloyal.Context) -> None:
    plain = shared_ctx.tokenize_sync("Hi", add_special=False)
    default = shared_ctx.tokenize_sync("Hi")
    bos = shared_ctx.bos_token
    if shared_ctx.model_info.architecture == "gemma3":
        assert bos is not None
        assert default == [bos, *plain]
    else:
        assert default[-len(plain) :] == plain


def test_parse_special(shared_ctx: lloyal.Context) -> None:
    eog_text = shared_ctx.token_to_text(shared_ctx.eog_token, render_special=True)
    parsed = shared_ctx.tokenize_sync(eog_text, add_special=False, parse_special=True)
    literal = shared_ctx.tokenize_sync(eog_text, add_special=False, parse_special=False)
    assert parsed == [shared_ctx.eog_token]
    assert len(literal) > 1


def test_empty_text_tokenizes_to_nothing(shared_ctx: lloyal.Context) -> None:
    assert shared_ctx.tokenize_sync("", add_special=False) == []
    assert asyncio.run(shared_ctx.detokenize([])) == ""


def test_stop_tokens(shared_ctx: lloyal.Context) -> None:
    assert shared_ctx.is_stop_token(shared_ctx.eog_token)
    word = shared_ctx.tokenize_sync("hello", add_special=False)[0]
    assert not shared_ctx.is_stop_token(word)


def test_token_to_text_never_raises_on_partial_utf8(shared_ctx: lloyal.Context) -> None:
    # Every token of the vocabulary converts; some are byte fragments.
    for token in range(0, shared_ctx.vocab_size, 97):
        assert isinstance(shared_ctx.token_to_text(token), str)


def test_text_stream_joins_to_exact_text(shared_ctx: lloyal.Context) -> None:
    text = "emoji 🚀🎉 and 漢字 streamed"
    stream = lloyal.TextStream(shared_ctx)
    tokens = shared_ctx.tokenize_sync(text, add_special=False)
    pieces = [stream.push(t) for t in tokens]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in p for p in pieces)


# -- chat templates ----------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def test_smollm2_renders_its_own_template(smollm2: object) -> None:
    from tests.conftest import open_sync

    ctx = open_sync(smollm2, n_ctx=256)  # type: ignore[arg-type]
    try:
        chat = ctx.format_chat(MESSAGES)
        assert chat.template_source == "model"
        assert chat.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
        assert chat.prompt.endswith("<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n")
        im_end = ctx.tokenize_sync("<|im_end|>", add_special=False)
        assert im_end[0] in chat.stop_tokens
        no_prompt = ctx.format_chat(MESSAGES, add_generation_prompt=False)
        assert not no_prompt.prompt.endswith("assistant\n")
        assert ctx.turn_separator == ctx.tokenize_sync("<|im_end|>\n", add_special=False)
    finally:
        ctx.close()


def test_gemma3_base_model_needs_an_explicit_template(gemma3: object) -> None:
    from tests.conftest import open_sync

    ctx = open_sync(gemma3, n_ctx=256)  # type: ignore[arg-type]
    try:
        assert ctx.chat_template is None
        with pytest.raises(lloyal.ChatTemplateError, match="no chat template"):
            ctx.format_chat(MESSAGES)
        chat = ctx.format_chat(MESSAGES, template="gemma")
        assert chat.template_source == "gemma"
        assert chat.prompt.startswith(
            "<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n"
        )
        assert chat.prompt.endswith("<start_of_turn>model\n")
        end_of_turn = ctx.tokenize_sync("<end_of_turn>", add_special=False)
        assert end_of_turn[0] in chat.stop_tokens
        # The rendered prompt starts with BOS already: tokenize without adding one.
        tokens = ctx.tokenize_sync(chat.prompt, add_special=False)
        assert tokens[0] == ctx.bos_token
        assert ctx.turn_separator == [ctx.eog_token]
    finally:
        ctx.close()


def test_custom_template_and_variables(shared_ctx: lloyal.Context) -> None:
    template = (
        "{% for m in messages %}[{{ m.role | upper }}] {{ m.content.strip() }}\n{% endfor %}"
        "{{ greeting }}"
    )
    chat = shared_ctx.format_chat(
        [{"role": "user", "content": "  hi  "}], template=template, greeting="bye"
    )
    assert chat.prompt == "[USER] hi\nbye"
    assert chat.template_source == "custom"


def test_every_builtin_template_renders(shared_ctx: lloyal.Context) -> None:
    for name in lloyal.BUILTIN_CHAT_TEMPLATES:
        chat = shared_ctx.format_chat(MESSAGES, template=name)
        assert "What is 2+2?" in chat.prompt
        assert "And 3+3?" in chat.prompt


def test_template_errors_are_clear(shared_ctx: lloyal.Context) -> None:
    with pytest.raises(lloyal.ChatTemplateError, match="does not parse"):
        shared_ctx.format_chat(MESSAGES, template="{% for m in messages %}")
    with pytest.raises(lloyal.ChatTemplateError, match="nope"):
        shared_ctx.format_chat(MESSAGES, template="{{ raise_exception('nope') }}")
    with pytest.raises(TypeError):
        shared_ctx.format_chat("not a list")  # type: ignore[arg-type]
    assert lloyal.Context.validate_chat_template("{{ messages[0].content }}")
    assert not lloyal.Context.validate_chat_template("{% if %}")
