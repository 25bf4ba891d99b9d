"""Grammar-constrained decoding (llguidance).

A grammar is written as GBNF text (llama.cpp's format), as a Lark grammar
(llguidance's dialect) or as a JSON schema. It compiles against one model's
vocabulary; an invalid grammar or schema raises :class:`GrammarError` when it
is created, never later and never silently unconstrained.

Branches carry a grammar (``Branch.create(..., json_schema=...)``,
``branch.set_grammar(...)``) and clone it on fork. The flat loop uses a
:class:`Grammar` handle directly: ``apply`` masks logits, ``accept`` advances.
End-of-generation tokens are allowed exactly where the grammar accepts.

JSON schemas default to compact output (``", "`` and ``": "`` separators, no
free whitespace); give the schema an ``"x-guidance"`` object to override
(llguidance's ``whitespace_flexible``, ``item_separator``, ``key_separator``).

A *lazy* grammar (``triggers=[...]``) constrains nothing until the text
produced contains one of its trigger words; from the trigger's first
character on, the output must match the grammar, so write the grammar to
start with the trigger. This is how tool calls are constrained without
constraining the prose around them (:meth:`Context.format_chat` with
``tools=`` returns such a grammar). A token that completes a trigger but
continues in a way the grammar rejects is not allowed. When the trigger
starts where a token starts, the grammar is given the tokens themselves,
so a trigger that is a special token (``<|call|>``) matches a grammar
that names that token (``<[id]>`` or ``<|call|>`` in Lark); a trigger
starting inside a token is given as its text.

Supported GBNF: rules (continued after ``|`` or inside parentheses),
``root``, string literals, character classes, ``.``, grouping, alternation,
``* + ? {m} {m,} {m,n} {,n}``, the escapes ``\\n \\r \\t \\\\ \\" \\xHH
\\uHHHH \\UHHHHHHHH`` and ``#`` comments. Token references (``<...>``) and
``!`` raise :class:`GrammarError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from lloyal import _lloyal

__all__ = ["Grammar", "json_schema_to_grammar"]


class _Compiler(Protocol):
    """What compiling needs of a :class:`~lloyal.Context` (structural, so
    this module does not import the context's)."""

    _native: _lloyal.NativeContext

    def _check_open(self) -> None: ...


def json_schema_to_grammar(schema: Mapping[str, Any] | str) -> str:
    """GBNF text for a JSON schema, from llama.cpp's own converter (the text
    can be read, edited and passed back as ``grammar=``).

    >>> import lloyal
    >>> print(lloyal.json_schema_to_grammar({"type": "boolean"}).splitlines()[0])
    root ::= ("true" | "false")
    """
    return _lloyal.json_schema_to_grammar(_schema_text(schema))


def _schema_text(schema: Mapping[str, Any] | str | bool) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, (Mapping, bool)):
        return json.dumps(schema)
    raise TypeError(f"a JSON schema is a dict or JSON text, got {type(schema).__name__}")


def _source(
    grammar: str | Grammar | None,
    json_schema: Mapping[str, Any] | str | bool | None,
    lark: str | None,
) -> tuple[str, str] | Grammar | None:
    """Which one grammar the caller gave: (kind, text), a handle, or None."""
    given = [g for g in (grammar, json_schema, lark) if g is not None]
    if len(given) > 1:
        raise ValueError("give at most one of grammar=, json_schema= and lark=")
    if isinstance(grammar, Grammar):
        return grammar
    if grammar is not None:
        if not isinstance(grammar, str):
            raise TypeError(f"grammar= takes GBNF text or a Grammar, got {type(grammar).__name__}")
        return ("gbnf", grammar)
    if json_schema is not None:
        return ("json_schema", _schema_text(json_schema))
    if lark is not None:
        if not isinstance(lark, str):
            raise TypeError(f"lark= takes Lark text, got {type(lark).__name__}")
        return ("lark", lark)
    return None


def _compile(
    ctx: _Compiler,
    grammar: str | Grammar | None,
    json_schema: Mapping[str, Any] | str | bool | None,
    lark: str | None,
    triggers: Sequence[str] | None = None,
) -> Grammar | None:
    source = _source(grammar, json_schema, lark)
    words = _triggers(triggers)
    if source is None or isinstance(source, Grammar):
        if words is not None:
            raise ValueError(
                "triggers= needs a grammar given as text (grammar=, json_schema= or lark=)"
            )
        return source
    ctx._check_open()
    return Grammar(ctx._native.create_grammar(*source, words))


def _triggers(triggers: Sequence[str] | None) -> list[str] | None:
    if triggers is None:
        return None
    if isinstance(triggers, str):
        raise TypeError("triggers= takes a list of strings, not one string")
    words = list(triggers)
    if not words or not all(isinstance(w, str) and w for w in words):
        raise ValueError("triggers= needs at least one non-empty string")
    return words


class Grammar:
    """A grammar matcher for the flat decode loop (create it with
    :meth:`Context.create_grammar`).

    >>> import asyncio, lloyal
    >>> import numpy as np
    >>> async def main():
    ...     async with await lloyal.create_context(MODEL) as ctx:
    ...         g = ctx.create_grammar('root ::= "yes" | "no"')
    ...         await ctx.decode(await ctx.tokenize("Is water wet? Answer:"), 0)
    ...         logits = ctx.get_logits().copy()
    ...         g.apply(logits)  # forbidden tokens -> -inf
    ...         allowed = [ctx.token_to_text(int(t)) for t in np.flatnonzero(logits > -np.inf)]
    ...         for t in ctx.tokenize_sync("no", add_special=False):
    ...             g.accept(t)
    ...         return sorted(allowed), g.is_accepting
    >>> asyncio.run(main())
    (['n', 'no', 'y', 'ye', 'yes'], True)
    """

    __slots__ = ("_native",)

    def __init__(self, native: _lloyal.NativeGrammar) -> None:
        self._native = native

    def clone(self) -> Grammar:
        """An independent copy in the same state."""
        return Grammar(self._native.clone_grammar())

    def apply(self, logits: np.ndarray[Any, np.dtype[np.float32]]) -> None:
        """Set forbidden tokens' logits to ``-inf``, in place. ``logits`` must
        be a writable, contiguous float32 array of vocabulary size."""
        if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 or logits.ndim != 1:
            raise TypeError("logits must be a 1-D float32 numpy array")
        if not logits.flags.c_contiguous or not logits.flags.writeable:
            raise ValueError("logits must be contiguous and writable (use .copy())")
        self._native.apply(logits)

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next (changes nothing)."""
        return bool(self._native.allows(int(token)))

    def accept(self, token: int) -> None:
        """Advance past ``token``. A token the grammar forbids raises
        :class:`GrammarError` and changes nothing."""
        self._native.accept(int(token))

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._native.reset()

    @property
    def is_accepting(self) -> bool:
        """Whether the text so far is complete (a stop token is allowed)."""
        return bool(self._native.is_accepting())

    @property
    def is_stopped(self) -> bool:
        """Whether nothing but a stop token can follow."""
        return bool(self._native.is_stopped())

    @property
    def triggered(self) -> bool | None:
        """``None`` for an ordinary grammar; for a lazy one (created with
        ``triggers=``), whether a trigger word has appeared yet."""
        return self._native.triggered()

    def __repr__(self) -> str:
        return f"<Grammar accepting={self.is_accepting}>"
