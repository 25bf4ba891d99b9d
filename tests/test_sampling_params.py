"""SamplingParams: the engine's own parameters as an immutable Python
object (no model needed)."""

from __future__ import annotations

import ast
import copy
import inspect
import pickle
from pathlib import Path

import lloyal
import pytest


def test_the_signature_states_the_real_defaults() -> None:
    sig = inspect.signature(lloyal.SamplingParams)
    defaults = lloyal.SamplingParams()
    assert len(sig.parameters) == 22
    for name, param in sig.parameters.items():
        assert param.kind is inspect.Parameter.KEYWORD_ONLY
        assert getattr(defaults, name) == param.default, name


def test_values_read_back_as_given() -> None:
    p = lloyal.SamplingParams(
        temperature=0.7, top_p=0.9, seed=2**64 - 1, logit_bias={5: 0.1, 7: -2}
    )
    assert p.temperature == 0.7
    assert p.top_p == 0.9
    assert p.seed == 2**64 - 1
    assert p.logit_bias == ((5, 0.1), (7, -2.0))
    assert lloyal.SamplingParams(logit_bias=[(5, 0.1)]).logit_bias == ((5, 0.1),)
    assert lloyal.SamplingParams(dry_sequence_breakers=["x"]).dry_sequence_breakers == ("x",)


def test_immutable_comparable_hashable_picklable() -> None:
    p = lloyal.SamplingParams(temperature=0.5, seed=1, logit_bias={3: 1.0})
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # type: ignore[misc]
    same = lloyal.SamplingParams(temperature=0.5, seed=1, logit_bias={3: 1.0})
    assert p == same
    assert hash(p) == hash(same)
    assert p != p.with_(seed=2)
    assert len({p, same, p.with_(seed=2)}) == 2
    assert pickle.loads(pickle.dumps(p)) == p
    assert copy.deepcopy(p) == p
    assert eval(repr(p), {"SamplingParams": lloyal.SamplingParams}) == p


def test_with_changes_only_what_it_names() -> None:
    p = lloyal.SamplingParams(seed=4, top_k=7)
    q = p.with_(temperature=0)
    assert (q.seed, q.top_k, q.temperature, q.is_greedy) == (4, 7, 0.0, True)
    assert p.temperature == 0.8
    with pytest.raises(TypeError, match="unexpected keyword argument 'tmperature'"):
        p.with_(tmperature=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        p.with_(top_p=2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"temperature": "hot"}, TypeError, "temperature must be a float, got str"),
        ({"temperature": True}, TypeError, "temperature must be a float, got bool"),
        ({"temperature": float("nan")}, ValueError, "temperature must be finite"),
        ({"top_k": 2.5}, TypeError, "top_k must be an int, got float"),
        ({"top_k": -1}, ValueError, "top_k must be >= 0"),
        ({"top_k": 2**40}, ValueError, "top_k is out of range"),
        ({"seed": -1}, ValueError, r"seed must be in \[0, 2\*\*64\)"),
        ({"seed": 1.0}, TypeError, "seed must be an int or None"),
        ({"mirostat": 1}, ValueError, "mirostat must be 0"),
        ({"logit_bias": {-1: 1.0}}, ValueError, "logit_bias token ids must be >= 0"),
        ({"logit_bias": 5}, TypeError, "logit_bias must be a dict or pairs"),
        ({"dry_sequence_breakers": "ab"}, TypeError, "sequence of strings"),
        ({"dry_base": 0.5}, ValueError, "dry_base must be >= 1"),
    ],
)
def test_bad_values_are_typed_errors(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        lloyal.SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_arguments_are_keywords() -> None:
    with pytest.raises(TypeError):
        lloyal.SamplingParams(0.5)  # type: ignore[misc]


def test_the_field_list_the_signature_and_the_stub_agree() -> None:
    """The fields are defined once (``for_every_field!`` in
    crates/lloyal-py/src/sampling.rs; defaults from the core). The
    ``text_signature`` and the ``.pyi`` stub are written by hand: checked
    here against that list, in names, order and defaults."""
    defaults = lloyal.SamplingParams().__getnewargs_ex__()[1]
    assert list(inspect.signature(lloyal.SamplingParams).parameters) == list(defaults)
    stub = ast.parse(Path(lloyal._lloyal.__file__).with_name("_lloyal.pyi").read_text())
    (cls,) = [n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams"]
    (new,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__new__"]
    stubbed = {
        a.arg: ast.literal_eval(d)
        for a, d in zip(new.args.kwonlyargs, new.args.kw_defaults, strict=True)
        if d is not None
    }
    assert list(stubbed) == list(defaults)
    assert stubbed == defaults
    assert set(defaults) <= {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
