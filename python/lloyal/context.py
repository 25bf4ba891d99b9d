"""The context: a loaded model, one KV cache and the worker that drives it.

Length: :class:`Context` is the flat API in one class, as llama.cpp's own
context is: tokenizing, chat templates, decoding into sequences, logits,
sampling and the KV calls. Each method is a thin wrapper of one native call
with its documented, runnable example; the examples are most of the file,
and splitting the class over modules would hide where a method lives.
"""

from __future__ import annotations

import atexit
import json
import operator
import os
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import anyio
import numpy as np
import numpy.typing as npt

from lloyal import _check, _lloyal, _probe
from lloyal import adapters as _adapters
from lloyal._bridge import call_native
from lloyal.adapters import Adapters, ControlVector, Lora, LoraSpec
from lloyal.chat.format import prepare_chat
from lloyal.chat.prompt import ChatPrompt as ChatPrompt
from lloyal.errors import ContextClosedError
from lloyal.grammar import Grammar, _compile
from lloyal.media import MEDIA_MARKER, Media, MediaTable, ProjectorInfo, flatten_media
from lloyal.sampling import SamplingParams

Base = Literal["nats", "bits"]
Pooling = Literal["none", "mean", "cls", "last", "rank"]
KVType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
Logits = npt.NDArray[np.float32]

# Texts longer than this are tokenized on a worker thread so the event loop
# keeps running; shorter ones take microseconds and run inline.
_INLINE_TOKENIZE_CHARS = 16_384

_live_contexts: weakref.WeakSet[Context] = weakref.WeakSet()


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@atexit.register
def _close_all_at_exit() -> None:
    # Worker threads call back into Python. Close every context and wait for
    # the workers to exit while the interpreter is still whole: a worker
    # finishing a callback during finalization would abort the process.
    for ctx in list(_live_contexts):
        ctx.close()
    _lloyal.join_workers()


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model, read from its GGUF file."""

    path: Path
    name: str
    architecture: str
    n_params: int
    size_bytes: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    vocab_size: int
    has_chat_template: bool


@dataclass(frozen=True)
class FimTokens:
    """The vocabulary's fill-in-the-middle tokens (None: the model has
    none); :func:`lloyal.infill.fim_prompt` lays out a prompt with them.
    ``complete`` models can fill in the middle."""

    prefix: int | None
    suffix: int | None
    middle: int | None
    pad: int | None
    repo: int | None
    file_sep: int | None

    @property
    def complete(self) -> bool:
        return None not in (self.prefix, self.suffix, self.middle)


@dataclass(frozen=True)
class ContextStats:
    """Counters since the context was created.

    ``decode_calls`` counts ``llama_decode`` calls and ``tokens_decoded`` the
    tokens they carried; tests use them to prove how work was batched.
    ``decode_seconds`` is the wall time spent in those calls. On a GPU
    backend ``llama_decode`` returns before the GPU has finished (the wait
    happens when the logits are read), so there it undercounts the compute
    time: on an H100, 0.17 ms of a 1.36 ms step. ``tombstone_purges``
    counts the times a ``deterministic=True`` context ran out of cells and
    freed the cells branches had dropped (from then on a token may land
    before its prefix's cells: see ``docs/determinism.md``).
    ``media_encodes`` counts the images and audio clips encoded (a fork
    of a branch holding one shares its cells: no encode).
    """

    decode_calls: int
    tokens_decoded: int
    decode_seconds: float
    tombstone_purges: int = 0
    media_encodes: int = 0


_I32 = 2**31


def _token_id(token: int) -> int:
    """``token`` as an int that fits the native i32 (range is checked natively
    against the vocabulary, with the same message)."""
    if type(token) is int and -_I32 <= token < _I32:
        return token
    try:
        t = operator.index(token)
    except TypeError:
        raise TypeError(f"token ids must be integers, got {token!r}") from None
    if not -_I32 <= t < _I32:
        raise ValueError(f"token id {t} is out of range")
    return t


def _token_list(tokens: Iterable[int]) -> list[int]:
    if isinstance(tokens, (str, bytes)):
        raise TypeError("tokens must be a sequence of integers, not text")
    if not isinstance(tokens, Iterable):
        raise TypeError(f"tokens must be a sequence of integers, got {type(tokens).__name__}")
    return [_token_id(t) for t in tokens]


def _logits_arg(logits: npt.ArrayLike | None) -> Logits | None:
    if logits is None:
        return None
    arr = np.ascontiguousarray(logits, dtype=np.float32)
    if arr.ndim != 1:
        raise ValueError(f"logits must be one-dimensional, got shape {arr.shape}")
    return arr


class Context:
    """A model, its KV cache and the worker thread that owns them.

    Create one with :func:`create_context`. Methods that run the model are
    coroutines; cheap reads are plain attributes. Every sequence shares one
    unified KV pool of ``n_ctx`` cells.

    >>> import asyncio, lloyal
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL, n_ctx=512) as ctx:
    ...         prompt = await ctx.tokenize("The capital of France is")
    ...         await ctx.decode(prompt, 0)
    ...         token = ctx.greedy_sample()
    ...         return ctx.token_to_text(token)
    >>> asyncio.run(main())
    ' Paris'
    """

    def __init__(self, native: _lloyal.NativeContext) -> None:
        self._native = native
        self._turn_separator: tuple[int, ...] | None = None
        self._media = MediaTable(native)
        self._projector: ProjectorInfo | None = None
        _live_contexts.add(self)

    # -- lifecycle -----------------------------------------------------------

    async def aclose(self) -> None:
        """Close the context. Queued operations fail with
        :class:`ContextClosedError`; closing twice is a no-op.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     ctx = await lloyal.create_context(MODEL)
        ...     await ctx.aclose()  # what leaving ``async with`` does
        ...     try:
        ...         await ctx.tokenize("hi")
        ...     except lloyal.ContextClosedError:
        ...         return "closed"
        >>> asyncio.run(main())
        'closed'
        """
        if self._native.closed:
            return
        await call_native(self._native.close)

    def close(self) -> None:
        """Close and wait for the worker thread (blocking; prefer ``aclose``).

        >>> import asyncio, lloyal
        >>> ctx = asyncio.run(lloyal.create_context(MODEL))
        >>> ctx.close()  # from code that is not async
        >>> ctx.close()  # twice is a no-op
        """
        self._native.close_sync()

    async def __aenter__(self) -> Context:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return bool(self._native.closed)

    def _check_open(self) -> None:
        if self._native.closed:
            raise ContextClosedError("the context is closed")

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        info = self.model_info
        return f"<lloyal.Context {info.name or info.path.name!r} n_ctx={self.n_ctx} {state}>"

    # -- attributes ----------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self._native.vocab_size)

    @property
    def n_ctx(self) -> int:
        """KV cells in the pool every sequence shares."""
        return int(self._native.n_ctx)

    @property
    def n_batch(self) -> int:
        """Most tokens per ``llama_decode`` call: the requested ``n_batch``,
        clamped to ``n_ctx`` (llama.cpp does the same, and aborts on a larger
        decode), and for embedding contexts a multiple of ``n_seq_max``."""
        return int(self._native.n_batch)

    @property
    def decode_threads(self) -> int:
        """The threads its decodes use now. ``n_threads`` when given; for a
        CPU context created without it (every core), one fewer for each
        ~100 ms of decoding in which the worker thread waited more than 15%
        of the time for a core (other processes, or this one's other
        threads, wanting them), down to 1, and one more again, on
        probation, once the wait is gone (Linux: the kernel's per-thread
        run-queue statistics; elsewhere, with ``deterministic=True``, on a
        GPU and with ``LLOYAL_ADAPTIVE_THREADS=0``, always ``n_threads``).
        docs/performance.md has the measurements.

        >>> import asyncio, lloyal
        >>> from lloyal.models import model_path
        >>> async def main():
        ...     async with await lloyal.create_context(
        ...         model_path("smollm2"), n_ctx=256, n_threads=2
        ...     ) as ctx:
        ...         return ctx.n_threads, ctx.decode_threads
        >>> asyncio.run(main())
        (2, 2)
        """
        return int(self._native.decode_threads)

    @property
    def step_tokens(self) -> int | None:
        """The most tokens one round of the step scheduler decodes, or
        None (the default): ``n_batch``.

        Commits (one token per streaming branch) go first; prompt tokens
        fill what is left of the budget, and at least a quarter of it, so
        a long prompt is decoded in chunks beside the streams instead of
        stalling every stream for a whole ``n_batch`` (vLLM's
        ``max_num_batched_tokens``; ``lloyal serve --step-tokens``). A
        prefill alone then takes ``ceil(tokens / step_tokens)`` decodes.
        Set it to any value in ``[1, n_batch]`` (larger is clamped to
        ``n_batch``); it applies from the next round. A budget of 0 raises
        ``ValueError``.

        >>> import asyncio, lloyal
        >>> from lloyal.models import model_path
        >>> async def main():
        ...     async with await lloyal.create_context(model_path("smollm2"), n_ctx=512) as ctx:
        ...         ctx.step_tokens = 64
        ...         root = lloyal.Branch.create(ctx)
        ...         before = ctx.stats.decode_calls
        ...         await root.prefill(list(range(100, 300)))  # 200 tokens
        ...         return ctx.step_tokens, ctx.stats.decode_calls - before
        >>> asyncio.run(main())
        (64, 4)
        """
        return self._native.step_tokens

    @step_tokens.setter
    def step_tokens(self, tokens: int | None) -> None:
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)):
            raise TypeError(f"step_tokens must be an int or None, not {type(tokens).__name__}")
        if tokens is not None and not 1 <= tokens <= 2**31:
            raise ValueError(f"step_tokens must be >= 1 (or None), got {tokens}")
        self._native.step_tokens = tokens

    @property
    def n_seq_max(self) -> int:
        """How many sequences can hold KV at once."""
        return int(self._native.n_seq_max)

    @property
    def n_gpu_layers(self) -> int:
        """The layers on the GPU: ``n_gpu_layers="auto"`` resolved, ``-1``
        for every layer, ``0`` for none (always ``0`` without a GPU)."""
        return int(self._native.n_gpu_layers)

    @property
    def n_threads(self) -> int:
        return int(self._native.n_threads)

    @property
    def embedding_dim(self) -> int:
        return int(self._native.embedding_dim)

    @property
    def memory_size(self) -> int:
        """Model weights plus the full-size KV cache, in bytes (the KV part is
        computed from the model's hyper-parameters)."""
        return int(self._native.memory_size)

    @property
    def model_info(self) -> ModelInfo:
        d = self._native.model_info()
        return ModelInfo(**{**d, "path": Path(d["path"])})

    @property
    def stats(self) -> ContextStats:
        return ContextStats(**self._native.stats())

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template stored in the GGUF, if any."""
        return self._native.chat_template

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as a string, e.g. ``"general.architecture"``.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         return ctx.metadata("general.architecture"), ctx.metadata("no.such.key")
        >>> asyncio.run(main())
        ('llama', None)
        """
        return self._native.meta(key)

    # -- text ----------------------------------------------------------------

    def tokenize_sync(
        self, text: str, add_special: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Tokenize without awaiting. ``add_special=None`` follows the model's
        BOS flag; ``parse_special`` turns ``<|im_start|>``-style text into
        special tokens.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         return ctx.tokenize_sync("Hello", add_special=False) == await ctx.tokenize(
        ...             "Hello", add_special=False)
        >>> asyncio.run(main())
        True
        """
        self._check_open()
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        return list(self._native.tokenize(text, add_special, parse_special))

    async def tokenize(
        self,
        text: str,
        add_special: bool | None = None,
        parse_special: bool = True,
        *,
        media: Sequence[Any] | None = None,
    ) -> list[int]:
        """Tokenize ``text`` (long texts on a thread, so the loop keeps running).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         tokens = await ctx.tokenize("Hello world", add_special=False)
        ...         return await ctx.detokenize(tokens)
        >>> asyncio.run(main())
        'Hello world'

        With ``media`` (one per :data:`MEDIA_MARKER <lloyal.MEDIA_MARKER>`
        in ``text``, anything :meth:`Media.coerce <lloyal.Media.coerce>`
        takes), each marker becomes its medium's run of placeholder ids
        (negative, one per position it takes; see :mod:`lloyal.media`),
        which :meth:`Branch.prefill <lloyal.Branch.prefill>` encodes.
        The text between markers is tokenized piece by piece, as libmtmd
        does. Needs a projector (:meth:`load_projector`).
        """
        _check.instance(text, str, "text", "a str")
        if media is not None:
            return await self._tokenize_media(text, add_special, parse_special, media)
        if len(text) <= _INLINE_TOKENIZE_CHARS:
            return self.tokenize_sync(text, add_special, parse_special)
        return await anyio.to_thread.run_sync(self.tokenize_sync, text, add_special, parse_special)

    async def _tokenize_media(
        self,
        text: str,
        add_special: bool | None,
        parse_special: bool,
        media: Sequence[Any],
    ) -> list[int]:
        if isinstance(media, (str, bytes)) or not isinstance(media, Sequence):
            raise TypeError("media must be a sequence of media (one per marker)")
        items = [Media.coerce(m) for m in media]
        pieces = text.split(MEDIA_MARKER)
        if len(pieces) != len(items) + 1:
            raise ValueError(
                f"the text has {len(pieces) - 1} media markers and {len(items)} media were given"
            )
        self._check_open()
        if self._projector is None:
            raise ValueError("no projector is loaded: pass mmproj= or call load_projector")
        out = await self.tokenize(pieces[0], add_special, parse_special)
        for medium, piece in zip(items, pieces[1:], strict=True):
            out += await self._media.placeholders(medium)
            if piece:
                out += await self.tokenize(piece, False, parse_special)
        self._media.check_held(out)
        return out

    async def detokenize(self, tokens: Sequence[int], *, render_special: bool = False) -> str:
        """Text of ``tokens``. Special tokens are omitted unless
        ``render_special``; a character cut off at the end becomes U+FFFD.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         tokens = await ctx.tokenize("Hello, world", add_special=False)
        ...         return await ctx.detokenize(tokens)
        >>> asyncio.run(main())
        'Hello, world'
        """
        self._check_open()
        ids = _token_list(tokens)
        if len(ids) <= _INLINE_TOKENIZE_CHARS // 4:
            return str(self._native.detokenize(ids, render_special))
        return str(await anyio.to_thread.run_sync(self._native.detokenize, ids, render_special))

    def token_bytes(self, token: int, *, render_special: bool = False) -> bytes:
        """The raw bytes of one token (may be part of a UTF-8 character).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         token = (await ctx.tokenize("é", add_special=False))[0]
        ...         return ctx.token_bytes(token)
        >>> asyncio.run(main())
        b'\\xc3\\xa9'
        """
        self._check_open()
        return bytes(self._native.token_bytes(_token_id(token), render_special))

    def token_to_text(self, token: int, *, render_special: bool = False) -> str:
        """Text of one token. Never raises on partial UTF-8 (bytes that are
        not a whole character become U+FFFD); use :class:`TextStream` to
        stream text exactly.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         token = (await ctx.tokenize(" Paris", add_special=False))[0]
        ...         return ctx.token_to_text(token), ctx.token_to_text(ctx.eog_token) == ""
        >>> asyncio.run(main())
        (' Paris', True)
        """
        return self.token_bytes(token, render_special=render_special).decode(
            "utf-8", errors="replace"
        )

    def is_stop_token(self, token: int) -> bool:
        """Whether ``token`` ends generation (any end-of-generation token).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         word = (await ctx.tokenize("hello", add_special=False))[0]
        ...         return ctx.is_stop_token(ctx.eog_token), ctx.is_stop_token(word)
        >>> asyncio.run(main())
        (True, False)
        """
        self._check_open()
        return bool(self._native.is_stop_token(_token_id(token)))

    @property
    def eog_token(self) -> int:
        """The model's end-of-generation token."""
        return int(self._native.eog_token)

    @property
    def bos_token(self) -> int | None:
        return self._native.bos_token

    @property
    def fim_tokens(self) -> FimTokens:
        """The model's fill-in-the-middle tokens (SmolLM2 has only a
        repository marker; ``lloyal.fixtures.fim_model`` is a copy with all
        of them).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         fim = ctx.fim_tokens
        ...         return fim.complete, fim.repo is not None
        >>> asyncio.run(main())
        (False, True)
        """
        return FimTokens(**self._native.fim_tokens())

    @property
    def turn_separator(self) -> list[int]:
        """Tokens the chat template writes after an assistant message (e.g.
        ChatML's ``<|im_end|>\\n``): append them to close a generated turn
        before adding the next user message to a live sequence. Models
        without a template get ``[eog_token]``."""
        if self._turn_separator is None:
            self._check_open()
            self._turn_separator = tuple(self._native.turn_separator(None))
        return list(self._turn_separator)

    def format_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] = "auto",
        parallel_tool_calls: bool = True,
        json_schema: Mapping[str, Any] | bool | None = None,
        enable_thinking: bool | None = None,
        **template_kwargs: Any,
    ) -> ChatPrompt:
        """Render ``messages`` with a Jinja chat template.

        ``template=None`` uses the template stored in the GGUF and raises
        :class:`ChatTemplateError` when there is none (base models). Pass a
        built-in name (:data:`BUILTIN_CHAT_TEMPLATES`: ``"chatml"``,
        ``"gemma"``, ``"llama3"``, ``"phi3"``) or Jinja source instead.
        Extra keyword arguments become template variables.

        ``tools`` (OpenAI-style function specs) are shown to the model and
        the result carries a grammar for the calls (:mod:`lloyal.chat.format`):
        lazy with ``tool_choice="auto"`` (it waits for the call opener),
        from the first token with ``"required"`` or
        ``{"type": "function", "function": {"name": ...}}``; ``"none"``
        leaves tools out. ``parallel_tool_calls=False`` allows one call.
        ``json_schema`` constrains the whole reply; with tools too (as
        OpenAI's ``response_format``), the reply is either the calls or an
        answer matching the schema, from its first token (with
        ``tool_choice="required"``, the calls).
        ``enable_thinking`` is passed to templates that read it (Qwen 3).
        Content parts may hold images and audio (see :mod:`lloyal.media`):
        each becomes a :data:`MEDIA_MARKER <lloyal.MEDIA_MARKER>` in the
        text, and :attr:`ChatPrompt.media` lists them in order, for
        ``ctx.tokenize(prompt.prompt, media=prompt.media)``.
        Earlier ``tool_calls`` and ``role: "tool"`` messages are accepted;
        for templates that know nothing of tools they are rewritten as text.
        :meth:`ChatPrompt.parse` reads the reply back.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         chat = ctx.format_chat([{"role": "user", "content": "Hi"}])
        ...         return chat.prompt
        >>> print(asyncio.run(main()))
        <|im_start|>system
        You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
        <|im_start|>user
        Hi<|im_end|>
        <|im_start|>assistant
        <BLANKLINE>
        """
        self._check_open()
        if isinstance(messages, (str, bytes)) or not all(isinstance(m, Mapping) for m in messages):
            raise TypeError("messages must be a sequence of dicts with 'role' and 'content'")
        messages, media = flatten_media(messages)
        if template is None:
            source = self.chat_template or ""
        elif template in BUILTIN_CHAT_TEMPLATES:
            source = ""
        else:
            source = template
        spec = prepare_chat(
            source,
            messages,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            json_schema=json_schema,
            enable_thinking=enable_thinking,
            special_id=lambda marker: next(iter(self._special_tokens([marker])), None),
        )
        extra = {**spec.variables, **template_kwargs}
        try:
            messages_json = json.dumps(spec.messages)
            extra_json = json.dumps(extra) if extra else None
        except TypeError as e:
            raise TypeError(
                f"messages and template variables must be JSON-serialisable: {e}"
            ) from None
        prompt, stop, source_name = self._native.format_chat(
            messages_json, add_generation_prompt, template, extra_json
        )
        if spec.think[1] != "</think>":
            # A family whose end of reasoning is an end-of-turn marker too
            # (harmony's <|end|>): the reply goes on after it.
            closer = set(self._special_tokens([spec.think[1]]))
            stop = [t for t in stop if t not in closer]
        if media and prompt.count(MEDIA_MARKER) != len(media):
            raise ValueError(
                f"the template wrote {prompt.count(MEDIA_MARKER)} media markers for "
                f"{len(media)} media (it dropped a message, or a text holds the marker)"
            )
        return ChatPrompt(
            prompt,
            tuple(stop),
            source_name,
            chat_format=spec.chat_format,
            grammar=spec.grammar,
            grammar_triggers=spec.triggers,
            preserved_tokens=tuple(self._special_tokens(spec.markers)),
            thinking_started=prompt.rstrip().endswith(spec.think[0]),
            think=spec.think,
            media=tuple(media),
        )

    def _special_tokens(self, markers: Iterable[str]) -> list[int]:
        """The markers that are single special tokens of this vocabulary."""
        out = []
        for marker in markers:
            ids = self._native.tokenize(marker, False, True)
            if len(ids) == 1 and not self._native.token_bytes(ids[0], False):
                out.append(int(ids[0]))
        return out

    @staticmethod
    def validate_chat_template(template: str) -> bool:
        """Whether ``template`` parses as a Jinja chat template.

        >>> import lloyal
        >>> good = "{% for m in messages %}{{ m.content }}{% endfor %}"
        >>> lloyal.Context.validate_chat_template(good)
        True
        >>> lloyal.Context.validate_chat_template("{% for m in messages %}")
        False
        """
        return bool(_lloyal.validate_chat_template(template))

    # -- the flat decode loop ------------------------------------------------

    async def decode(self, tokens: Sequence[int], pos: int, seq_id: int = 0) -> None:
        """Run the model over ``tokens`` at positions ``pos, pos+1, ...`` of
        sequence ``seq_id`` and keep the last token's logits.

        ``pos`` must continue the sequence (``kv_seq_pos_max(seq_id) + 1``);
        inputs longer than ``n_batch`` are split across several
        ``llama_decode`` calls. If the KV cache fills up, what this call added
        is removed again and :class:`KVCacheFullError` is raised.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         token = ctx.greedy_sample()
        ...         await ctx.decode([token], len(prompt))  # positions continue the sequence
        ...         return ctx.token_to_text(token), ctx.kv_seq_pos_max() == len(prompt)
        >>> asyncio.run(main())
        (' Paris', True)
        """
        self._check_open()
        ids = _token_list(tokens)
        p, seq = _check.integer(pos, "pos"), _check.integer(seq_id, "seq_id")
        await call_native(lambda done: self._native.decode(ids, p, seq, done))

    def kv_seq_pos_max(self, seq_id: int = 0) -> int:
        """Largest position held for ``seq_id``; ``-1`` when it is empty.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         return ctx.kv_seq_pos_max() == len(prompt) - 1, ctx.kv_seq_pos_max(1)
        >>> asyncio.run(main())
        (True, -1)
        """
        return int(self._native.kv_seq_pos_max(_check.integer(seq_id, "seq_id")))

    def get_logits(self) -> Logits:
        """The last decoded token's logits: a read-only float32 copy of shape
        ``(vocab_size,)`` that stays valid after later decodes.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         logits = ctx.get_logits()
        ...         best = int(logits.argmax()) == ctx.greedy_sample()
        ...         return logits.shape == (ctx.vocab_size,), best
        >>> asyncio.run(main())
        (True, True)
        """
        self._check_open()
        arr: Logits = self._native.get_logits()
        arr.flags.writeable = False
        return arr

    def sample(
        self, params: SamplingParams | None = None, logits: npt.ArrayLike | None = None
    ) -> int:
        """Sample a token from the last logits, or from ``logits`` you edited.

        The context keeps one sampler for this loop: its penalty history and
        random stream persist across calls (changing ``params`` keeps the
        history; a new ``seed`` restarts the stream). The sampled token is
        recorded in that history.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         logits = ctx.get_logits().copy()
        ...         logits[ctx.greedy_sample()] = -float("inf")  # not the best one
        ...         return ctx.sample(lloyal.GREEDY, logits=logits) != ctx.greedy_sample()
        >>> asyncio.run(main())
        True
        """
        self._check_open()
        return int(self._native.sample(params or SamplingParams(), _logits_arg(logits)))

    def greedy_sample(self) -> int:
        """The most likely next token (no penalties, no history).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         return ctx.token_to_text(ctx.greedy_sample())
        >>> asyncio.run(main())
        ' Paris'
        """
        self._check_open()
        return int(self._native.greedy_sample())

    def reset_sampler(self) -> None:
        """Forget the flat loop's penalty history and random stream.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         params = lloyal.SamplingParams(temperature=1.0, seed=3)
        ...         first = ctx.sample(params)
        ...         ctx.reset_sampler()  # the random stream starts over
        ...         return ctx.sample(params) == first
        >>> asyncio.run(main())
        True
        """
        self._native.reset_sampler()

    def model_entropy(self, base: Base = "nats", logits: npt.ArrayLike | None = None) -> float:
        """Entropy of the next-token distribution (last logits or ``logits``).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         nats, bits = ctx.model_entropy(), ctx.model_entropy("bits")
        ...         return nats > 0, abs(bits * 0.6931471805599453 - nats) < 1e-6
        >>> asyncio.run(main())
        (True, True)
        """
        self._check_open()
        return float(self._native.model_entropy(base, _logits_arg(logits)))

    def model_surprisal(
        self, token: int, base: Base = "nats", logits: npt.ArrayLike | None = None
    ) -> float:
        """``-log p(token)`` under the last logits (or ``logits``).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         best = ctx.greedy_sample()
        ...         worst = int(ctx.get_logits().argmin())
        ...         return ctx.model_surprisal(best) < ctx.model_surprisal(worst)
        >>> asyncio.run(main())
        True
        """
        self._check_open()
        return float(self._native.model_surprisal(_token_id(token), base, _logits_arg(logits)))

    # -- KV cache --------------------------------------------------------------

    def kv_cache_size(self, seq_id: int = 0) -> int:
        """Tokens held by ``seq_id`` (``kv_seq_pos_max(seq_id) + 1``).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         return ctx.kv_cache_size() == len(prompt)
        >>> asyncio.run(main())
        True
        """
        return int(self._native.kv_cache_size(_check.integer(seq_id, "seq_id")))

    async def kv_cache_remove(self, seq_id: int, start: int, end: int = -1) -> None:
        """Remove positions ``[start, end)`` of ``seq_id`` (``end=-1``: to the end).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         await ctx.kv_cache_remove(0, 2)  # keep the first two positions
        ...         return ctx.kv_cache_size()
        >>> asyncio.run(main())
        2
        """
        self._check_open()
        native = self._native
        await call_native(lambda done: native.kv_cache_remove(seq_id, start, end, done))

    def kv_seq_copy(self, src: int, dst: int) -> None:
        """Share ``src``'s cells with ``dst`` (unified KV: metadata only, no
        tensor copy). Queued on the worker: it takes effect before any later
        operation on this context.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         ctx.kv_seq_copy(0, 1)  # sequence 1 shares the cells
        ...         # ... so a token can follow them in sequence 1:
        ...         await ctx.decode([ctx.greedy_sample()], len(prompt), seq_id=1)
        ...         return ctx.kv_cache_size(1) == len(prompt) + 1
        >>> asyncio.run(main())
        True
        """
        self._check_open()
        self._native.kv_seq_copy(int(src), int(dst))

    def kv_seq_keep(self, seq_id: int) -> None:
        """Drop every cell that ``seq_id`` does not hold. Queued like
        :meth:`kv_seq_copy`; refused while branches hold KV.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, n_seq_max=2) as ctx:
        ...         await ctx.decode(await ctx.tokenize("One"), 0)
        ...         await ctx.decode(await ctx.tokenize("Two"), 0, seq_id=1)
        ...         ctx.kv_seq_keep(1)
        ...         await ctx.decode(await ctx.tokenize("Three"), 0)  # sequence 0 starts over
        ...         return ctx.kv_cache_size(1) > 0
        >>> asyncio.run(main())
        True
        """
        self._check_open()
        self._native.kv_seq_keep(_check.integer(seq_id, "seq_id"))

    async def kv_cache_clear(self) -> None:
        """Clear every sequence (refused while branches hold KV).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         await ctx.kv_cache_clear()
        ...         return ctx.kv_cache_size()
        >>> asyncio.run(main())
        0
        """
        self._check_open()
        await call_native(self._native.kv_cache_clear)

    async def kv_cache_save(self, seq_id: int = 0, tokens: Sequence[int] = ()) -> bytes:
        """Serialise ``seq_id``'s KV cells. ``tokens`` (what the sequence
        holds) travel with the state. The bytes load only into a context of
        the same model and KV types.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         tokens = await ctx.tokenize("Remember this")
        ...         await ctx.decode(tokens, 0)
        ...         state = await ctx.kv_cache_save(0, tokens)
        ...     async with await lloyal.create_context(MODEL) as fresh:
        ...         await fresh.kv_cache_load(0, state)
        ...         return fresh.kv_cache_size(0) == len(tokens)
        >>> asyncio.run(main())
        True
        """
        self._check_open()
        ids = _token_list(tokens)
        native = self._native
        data = await call_native(lambda done: native.kv_cache_save(seq_id, ids, done))
        return bytes(data)

    async def kv_cache_load(self, seq_id: int, data: bytes) -> list[int]:
        """Replace ``seq_id`` with a state from :meth:`kv_cache_save`; returns
        the tokens saved with it. Corrupt, truncated or foreign data raises
        :class:`StateError` and leaves the sequence empty.

        A state holds KV cells, not logits: to continue generating, save
        before decoding the last token and decode it after loading.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         data = await ctx.kv_cache_save(0, prompt)
        ...         await ctx.kv_cache_clear()
        ...         tokens = await ctx.kv_cache_load(0, data)
        ...         return tokens == prompt, ctx.kv_cache_size() == len(prompt)
        >>> asyncio.run(main())
        (True, True)
        """
        self._check_open()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data must be bytes, got {type(data).__name__}")
        native = self._native
        raw = bytes(data)
        return list(await call_native(lambda done: native.kv_cache_load(seq_id, raw, done)))

    async def kv_cache_write_file(
        self, seq_id: int, path: str | os.PathLike[str], tokens: Sequence[int]
    ) -> int:
        """Save ``seq_id`` (with ``tokens``) to a file; returns bytes written.

        >>> import asyncio, lloyal, os, tempfile
        >>> async def main():
        ...     path = os.path.join(tempfile.mkdtemp(), "seq0.kv")
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         written = await ctx.kv_cache_write_file(0, path, prompt)
        ...         await ctx.kv_cache_clear()
        ...         tokens = await ctx.kv_cache_read_file(0, path)
        ...         return written == os.path.getsize(path), tokens == prompt
        >>> asyncio.run(main())
        (True, True)
        """
        data = await self.kv_cache_save(seq_id, tokens)
        await anyio.Path(path).write_bytes(data)
        return len(data)

    async def kv_cache_read_file(self, seq_id: int, path: str | os.PathLike[str]) -> list[int]:
        """Load ``seq_id`` from a file written by :meth:`kv_cache_write_file`;
        returns the tokens saved with it.

        (See :meth:`kv_cache_write_file`.)

        >>> import asyncio, lloyal, os, tempfile
        >>> async def main():
        ...     path = os.path.join(tempfile.mkdtemp(), "junk.kv")
        ...     with open(path, "wb") as f:
        ...         f.write(b"junk")
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         try:
        ...             await ctx.kv_cache_read_file(0, path)
        ...         except lloyal.StateError:
        ...             return "refused"
        >>> asyncio.run(main())
        'refused'
        """
        data = await anyio.Path(path).read_bytes()
        return await self.kv_cache_load(seq_id, data)

    async def clear_and_reseed(
        self, sinks: Sequence[int], tail: Sequence[int], seq_id: int = 0
    ) -> None:
        """BlinkKV streaming past ``n_ctx``: clear ``seq_id``, then decode
        ``sinks + tail`` at contiguous positions from 0 (the next position is
        ``len(sinks) + len(tail)``). The flat sampler's penalty history is
        kept; the last logits are those of the tail's last token.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         tokens = await ctx.tokenize("word " * 100)
        ...         await ctx.decode(tokens, 0)
        ...         await ctx.clear_and_reseed(tokens[:4], tokens[-32:])  # sinks, then the tail
        ...         return ctx.kv_cache_size()
        >>> asyncio.run(main())
        36
        """
        self._check_open()
        s, t = _token_list(sinks), _token_list(tail)
        native = self._native
        await call_native(lambda done: native.clear_and_reseed(seq_id, s, t, done))

    # -- embeddings ------------------------------------------------------------

    @property
    def has_pooling(self) -> bool:
        """Whether this is an embedding context that pools (mean, cls, last)."""
        return bool(self._native.has_pooling())

    @property
    def is_reranker(self) -> bool:
        """Whether the model's GGUF declares a reranker (rank pooling and a
        classification head): what ``pooling="rank"`` needs."""
        return bool(self._native.is_reranker())

    @property
    def ranks(self) -> bool:
        """Whether this is a reranker's context (``embeddings=True,
        pooling="rank"`` on a model with a classification head): each input
        gives ``embedding_dim`` scores, never normalized
        (:class:`lloyal.Rerank` reads them)."""
        return bool(self._native.ranks())

    async def encode(self, tokens: Sequence[int]) -> None:
        """Run ``tokens`` through an embedding context (``embeddings=True``)
        and keep their embeddings for :meth:`get_embeddings`. Uses a free KV
        sequence for the call and clears it afterwards.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, embeddings=True) as ctx:
        ...         await ctx.encode(await ctx.tokenize("a cat"))
        ...         vector = ctx.get_embeddings()
        ...         return vector.shape == (ctx.embedding_dim,), round(float((vector**2).sum()), 3)
        >>> asyncio.run(main())
        (True, 1.0)
        """
        self._check_open()
        ids = _token_list(tokens)
        native = self._native
        await call_native(lambda done: native.encode(ids, done))

    def get_embeddings(self, normalize: bool = True) -> npt.NDArray[np.float32]:
        """The last :meth:`encode`'s embeddings: shape ``(dim,)`` when the
        context pools, ``(n_tokens, dim)`` with ``pooling="none"``. Rows are
        L2-normalized unless ``normalize=False``.

        (See :meth:`encode`.)

        >>> import asyncio, lloyal
        >>> async def main():
        ...     opts = {"embeddings": True, "pooling": "none"}
        ...     async with await lloyal.create_context(MODEL, **opts) as ctx:
        ...         tokens = await ctx.tokenize("a cat")
        ...         await ctx.encode(tokens)
        ...         rows = ctx.get_embeddings(normalize=False)  # one per token
        ...         return rows.shape == (len(tokens), ctx.embedding_dim)
        >>> asyncio.run(main())
        True
        """
        self._check_open()
        rows: npt.NDArray[np.float32] = self._native.get_embeddings()
        if normalize and not self.ranks:
            rows = _unit_rows(rows)
        return rows[0] if self.has_pooling or self.ranks else rows

    async def embed(
        self, text: str | Sequence[str], normalize: bool = True
    ) -> npt.NDArray[np.float32]:
        """Pooled embeddings of one text (shape ``(dim,)``) or of several
        (``(n, dim)``), computed in as few decodes as ``n_batch`` allows:
        each text gets its own KV sequence in the same batch. Needs a
        context created with ``embeddings=True`` and a pooling other than
        ``"none"``; a text longer than ``n_batch`` tokens raises ``ValueError``.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, embeddings=True) as ctx:
        ...         v = await ctx.embed(["a cat sat", "a kitten sat", "tax law"])
        ...         return v.shape == (3, ctx.embedding_dim), bool(v[0] @ v[1] > v[0] @ v[2])
        >>> asyncio.run(main())
        (True, True)
        """
        self._check_open()
        single = isinstance(text, str)
        texts = [text] if isinstance(text, str) else list(text)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("embed() takes a string or a sequence of strings")
        rows = await self.embed_tokens([await self.tokenize(t) for t in texts], normalize)
        return rows[0] if single else rows

    async def embed_tokens(
        self, inputs: Sequence[Sequence[int]], normalize: bool = True
    ) -> npt.NDArray[np.float32]:
        """:meth:`embed` of token lists (``(n, dim)``), as tokenized
        elsewhere (an OpenAI client's token-id input, say).

        >>> import asyncio, lloyal
        >>> import numpy as np
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL, embeddings=True) as ctx:
        ...         ids = await ctx.tokenize("a cat sat")
        ...         by_ids = await ctx.embed_tokens([ids])
        ...         return by_ids.shape, bool(np.allclose(by_ids[0], await ctx.embed("a cat sat")))
        >>> asyncio.run(main())
        ((1, 576), True)
        """
        self._check_open()
        if isinstance(inputs, (str, bytes)):
            raise TypeError("embed_tokens() takes a sequence of token lists")
        ids = [_token_list(t) for t in inputs]
        if not ids or not all(ids):
            raise ValueError("embed_tokens() needs at least one input, none of them empty")
        native = self._native
        rows: npt.NDArray[np.float32] = await call_native(lambda done: native.embed(ids, done))
        # A reranker's rows are scores: a unit vector of one would be 1.
        return _unit_rows(rows) if normalize and not self.ranks else rows

    def create_grammar(
        self,
        grammar: str | None = None,
        *,
        json_schema: Mapping[str, Any] | str | bool | None = None,
        lark: str | None = None,
        triggers: Sequence[str] | None = None,
    ) -> Grammar:
        """Compile a grammar for this model: GBNF text (``grammar=``), a JSON
        schema (dict or JSON text) or a Lark grammar; with ``triggers=``, a
        lazy grammar that waits for one of those words (see
        :mod:`lloyal.grammar`). Invalid input raises
        :class:`GrammarError`. The first grammar of a model also indexes its
        vocabulary (tens of milliseconds for 50k tokens, more for 250k).

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         g = ctx.create_grammar(json_schema={"type": "integer"})
        ...         return g.allows(ctx.tokenize_sync("7", add_special=False)[0])
        >>> asyncio.run(main())
        True
        """
        if grammar is None and json_schema is None and lark is None:
            raise ValueError("give one of grammar=, json_schema= or lark=")
        compiled = _compile(self, grammar, json_schema, lark, triggers)
        assert compiled is not None
        return compiled

    # -- adapters (see lloyal.adapters) ---------------------------------------

    async def load_lora(self, path: str | os.PathLike[str]) -> Lora:
        """Load a LoRA adapter (GGUF) into this context's model, checked
        against it first; the same file again gives the same adapter.

        >>> import asyncio, lloyal
        >>> from lloyal import fixtures
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         lora = await ctx.load_lora(fixtures.lora("random"))  # a test LoRA
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         b.set_adapters({lora: 0.5})
        ...         return b.adapters.loras == ((lora, 0.5),), lora == await ctx.load_lora(
        ...             fixtures.lora("random"))
        >>> asyncio.run(main())
        (True, True)
        """
        self._check_open()
        p = Path(os.fspath(path))
        return await call_native(lambda done: self._native.load_lora(p, done))  # type: ignore[no-any-return]

    def control_vector(
        self,
        directions: npt.ArrayLike,
        *,
        scale: float = 1.0,
        layers: tuple[int, int] | None = None,
    ) -> ControlVector:
        """A control vector from an ``(n_layer, n_embd)`` array, row ``i``
        added to layer ``i``'s output (row 0 must be zero: llama.cpp has
        none there), times ``scale``, in layers ``layers`` (first, last;
        default every layer from 1).

        >>> import asyncio, lloyal, numpy as np
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         n_layer = int(ctx.metadata("llama.block_count"))
        ...         directions = np.zeros((n_layer, ctx.model_info.n_embd), np.float32)
        ...         directions[1:, 0] = 0.1
        ...         cv = ctx.control_vector(directions, scale=2.0)
        ...         ctx.set_adapters(control_vector=cv)
        ...         return ctx.adapters.control_vector is not None
        >>> asyncio.run(main())
        True
        """
        data = np.ascontiguousarray(directions, dtype=np.float32).reshape(-1)
        return self._native.control_vector(data, float(scale), layers)

    def load_control_vector(
        self,
        path: str | os.PathLike[str],
        *,
        scale: float = 1.0,
        layers: tuple[int, int] | None = None,
    ) -> ControlVector:
        """Read a control vector file (``cvector-generator``'s GGUF); see
        :meth:`control_vector` for ``scale`` and ``layers``.

        >>> import asyncio, lloyal
        >>> from lloyal import fixtures
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         cv = ctx.load_control_vector(fixtures.control_vector(), scale=0.5)
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        ...         b.set_adapters(control_vector=cv)
        ...         return b.adapters.control_vector is not None
        >>> asyncio.run(main())
        True
        """
        return self._native.load_control_vector(Path(os.fspath(path)), float(scale), layers)

    def set_adapters(
        self, loras: LoraSpec = None, *, control_vector: ControlVector | None = None
    ) -> None:
        """The default adapter set: what new branches start with and what
        the flat API and embeddings decode under. Branches made before keep
        theirs.

        >>> import asyncio, lloyal
        >>> from lloyal import fixtures
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         lora = await ctx.load_lora(fixtures.lora("zero"))
        ...         ctx.set_adapters({lora: 1.0})
        ...         b = lloyal.Branch.create(ctx, lloyal.GREEDY)  # starts with the default set
        ...         return b.adapters == ctx.adapters
        >>> asyncio.run(main())
        True
        """
        self._native.set_default_adapters(*_adapters.split(loras, control_vector))

    @property
    def adapters(self) -> Adapters:
        """The default adapter set (see :meth:`set_adapters`)."""
        return _adapters.adapters(self._native.default_adapters())

    # -- media (see lloyal.media) ---------------------------------------------

    async def load_projector(self, path: str | os.PathLike[str]) -> ProjectorInfo:
        """Load a projector (the ``mmproj`` GGUF of a vision or audio
        model) for this context's model, replacing any loaded before.
        Raises ``FileNotFoundError`` for a missing file and
        :class:`ProjectorLoadError <lloyal.ProjectorLoadError>` for one
        that is not a projector for this model (nothing changes then).

        >>> import asyncio, lloyal
        >>> from lloyal import fixtures
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         info = await ctx.load_projector(fixtures.mmproj())  # a test projector
        ...         return info.vision, info.audio, ctx.projector == info
        >>> asyncio.run(main())
        (True, False, True)
        """
        self._check_open()
        p = Path(os.fspath(path))
        # In a probe process first: a projector libmtmd crashes on kills
        # the probe, not this process (lloyal._probe).
        await anyio.to_thread.run_sync(_probe.check_projector, self.model_info.path, p)
        info = await call_native(lambda done: self._native.load_projector(p, done))
        self._projector = ProjectorInfo(**info)
        self._media.reset()  # positions and encodings are the projector's
        return self._projector

    @property
    def projector(self) -> ProjectorInfo | None:
        """What the loaded projector takes (``None``: none loaded)."""
        return self._projector

    def create_perplexity_tracker(self) -> _lloyal.PerplexityTracker:
        """A fresh :class:`PerplexityTracker`.

        >>> import asyncio, lloyal
        >>> async def main():
        ...     async with await lloyal.create_context(MODEL) as ctx:
        ...         prompt = await ctx.tokenize("The capital of France is")
        ...         await ctx.decode(prompt, 0)
        ...         ppl = ctx.create_perplexity_tracker()
        ...         ppl.add(ctx.model_surprisal(ctx.greedy_sample()))
        ...         return ppl.count, ppl.perplexity >= 1.0
        >>> asyncio.run(main())
        (1, True)
        """
        return _lloyal.PerplexityTracker()


def _unit_rows(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return (rows / np.where(norms == 0, 1, norms)).astype(np.float32)


async def create_context(
    model_path: str | os.PathLike[str],
    *,
    n_ctx: int = 2048,
    n_batch: int = 512,
    n_seq_max: int = 1,
    n_threads: int | None = None,
    embeddings: bool = False,
    pooling: Pooling = "mean",
    type_k: KVType | None = None,
    type_v: KVType | None = None,
    n_gpu_layers: int | Literal["auto"] = "auto",
    fit_margin: int | None = None,
    deterministic: bool = False,
    mmproj: str | os.PathLike[str] | None = None,
) -> Context:
    """Load a GGUF model and create a context on its own worker thread.

    The KV cache is unified (every sequence draws from one pool of ``n_ctx``
    cells, so forks share their prefix) and sliding-window layers keep full
    size, so any sequence can be copied or trimmed anywhere. ``type_k`` /
    ``type_v`` set the cache's element types; ``"f32"`` doubles its size
    but gives the same logits as ``"f16"``, since llama.cpp's flash
    attention (on where the backend has it, as on the CPU) attends in f16.

    ``type_k`` / ``type_v`` default to ``"f16"``, or ``"q8_0"`` with
    ``deterministic=True``: then a branch's logits are the same bits
    whatever it is batched with, at any row, decoded in one call or split
    (CPU backend; ``docs/determinism.md`` has what it costs and why). It
    loads the weights unrepacked, needs a quantized KV cache, and sets
    ``GGML_CPU_TILED_MM=0`` for the whole process, so it must come before
    any other context of the process decodes (or the variable must be set
    at start).

    ``n_threads``: the decode threads; ``None`` (the default) takes the
    ``LLOYAL_THREADS`` environment variable when it holds a count, else
    every core, and adapts to a crowded machine (:attr:`Context.decode_threads`).

    ``n_gpu_layers``: ``"auto"`` (the default) offloads as many layers as
    fit the GPU's free memory, with this context's KV cache and compute
    buffers counted and ``fit_margin`` bytes (default 1 GiB) left free, as
    ``llama-server --fit`` chooses (:func:`fit_gpu_layers` says what it
    picks); with no GPU it offloads none, at no cost. ``-1`` offloads every
    layer, ``0`` none, ``n`` the last ``n``. :attr:`Context.n_gpu_layers`
    has the value used. ``docs/gpu.md``.

    ``mmproj``: a projector for images and audio (see :mod:`lloyal.media`
    and :meth:`Context.load_projector`).

    Raises ``FileNotFoundError`` for a missing file, :class:`ModelLoadError`
    for a file llama.cpp cannot load, ``ValueError`` for bad options.

    >>> import asyncio, lloyal
    >>> async def main():
    ...     ctx = await lloyal.create_context(MODEL, n_ctx=1024, n_seq_max=4)
    ...     async with ctx:
    ...         return ctx.n_ctx, ctx.n_seq_max, ctx.model_info.architecture
    >>> asyncio.run(main())
    (1024, 4, 'llama')
    """
    path = os.fspath(model_path)
    if not isinstance(path, str):
        raise TypeError("model_path must be a str or os.PathLike[str]")
    for name, value in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_seq_max", n_seq_max)):
        _check.integer(value, name)
    if n_threads is not None:
        _check.integer(n_threads, "n_threads")
    layers = _gpu_layers(n_gpu_layers)
    if fit_margin is not None:
        _check.integer(fit_margin, "fit_margin")
        if fit_margin < 0:
            raise ValueError(f"fit_margin must be >= 0 bytes, got {fit_margin}")
    _check.instance(embeddings, bool, "embeddings", "a bool")
    _check.instance(deterministic, bool, "deterministic", "a bool")
    if n_threads is not None and n_threads < 1:
        # (The engine checks the upper limit, llama.cpp's GGML_MAX_N_THREADS.)
        raise ValueError(f"n_threads must be >= 1 or None, got {n_threads}")
    for name, value in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_seq_max", n_seq_max)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    native = await call_native(
        lambda done: _lloyal.NativeContext.open(
            path,
            done,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_seq_max=n_seq_max,
            n_threads=n_threads,
            embeddings=embeddings,
            pooling=pooling,
            type_k=type_k,
            type_v=type_v,
            n_gpu_layers=layers,
            fit_margin=fit_margin,
            deterministic=deterministic,
        )
    )
    # Allowed (the engine refused above its own limit), but worth a word.
    cpus = _usable_cpus()
    if n_threads is not None and n_threads > cpus:
        warnings.warn(
            f"n_threads={n_threads} is more than the {cpus} CPUs this process may run on: "
            "llama.cpp's threads will take turns and decoding slows down",
            RuntimeWarning,
            stacklevel=2,
        )
    ctx = Context(native)
    if mmproj is not None:
        try:
            await ctx.load_projector(mmproj)
        except BaseException:
            await ctx.aclose()
            raise
    return ctx


BUILTIN_CHAT_TEMPLATES: tuple[str, ...] = tuple(_lloyal.builtin_chat_templates())
"""Names accepted by ``format_chat(template=...)`` besides Jinja source."""


def _gpu_layers(n_gpu_layers: object) -> int | None:
    """``n_gpu_layers`` for the engine: ``None`` for ``"auto"``."""
    if n_gpu_layers == "auto":
        return None
    if isinstance(n_gpu_layers, str):
        raise ValueError(f'n_gpu_layers must be "auto", -1 or a count >= 0, got {n_gpu_layers!r}')
    _check.integer(n_gpu_layers, "n_gpu_layers")
    assert isinstance(n_gpu_layers, int)
    if n_gpu_layers < -1:
        raise ValueError(f"n_gpu_layers must be >= -1, got {n_gpu_layers}")
    return n_gpu_layers


def fit_gpu_layers(
    model_path: str | os.PathLike[str],
    *,
    n_ctx: int = 2048,
    n_batch: int = 512,
    n_seq_max: int = 1,
    embeddings: bool = False,
    pooling: Pooling = "mean",
    type_k: KVType | None = None,
    type_v: KVType | None = None,
    fit_margin: int | None = None,
    deterministic: bool = False,
) -> int:
    """What ``n_gpu_layers="auto"`` would offload for this model and a
    context with these options: ``-1`` every layer, else a count (``0``
    without a GPU). It runs llama.cpp's parameter fitting, which reads the
    model file and measures its buffers without allocating them: it blocks
    for a fraction of a model load (call it through ``asyncio.to_thread``
    inside a loop). ``lloyal info --model`` prints it.

    >>> import lloyal
    >>> lloyal.fit_gpu_layers(MODEL) if not lloyal.supports_gpu_offload() else 0
    0
    """
    path = os.fspath(model_path)
    if not isinstance(path, str):
        raise TypeError("model_path must be a str or os.PathLike[str]")
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    for name, value in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_seq_max", n_seq_max)):
        _check.integer(value, name)
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if fit_margin is not None:
        _check.integer(fit_margin, "fit_margin")
        if fit_margin < 0:
            raise ValueError(f"fit_margin must be >= 0 bytes, got {fit_margin}")
    return int(
        _lloyal.fit_gpu_layers(
            path,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_seq_max=n_seq_max,
            embeddings=embeddings,
            pooling=pooling,
            type_k=type_k,
            type_v=type_v,
            fit_margin=fit_margin,
            deterministic=deterministic,
        )
    )
