"""LoRA adapters and a control vector on the server, as llama-server has
them: ``--lora`` / ``--lora-scaled`` load adapters at startup, numbered
from 0 in the order given; their scales are the default set of every
request (``GET`` / ``POST /lora-adapters`` read and change it); a request's
``"lora": [{"id": 0, "scale": 0.5}]`` replaces it for that request alone
(adapters it leaves out are off). Requests under different sets are decoded
apart, one decode per set in a step (``lloyal.adapters``), and the prefix
cache reuses a prompt only under the set it was decoded with. A control
vector (``--control-vector``) applies to every request.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from lloyal.adapters import Adapters, Lora
from lloyal.context import Context
from lloyal.server._protocol import ApiError, lora_field, parse_json

Scaled = tuple[str | os.PathLike[str], float]


async def load(
    ctx: Context,
    loras: Sequence[Scaled],
    control_vector: Scaled | None,
    layers: tuple[int, int] | None,
) -> list[Lora]:
    """Load the server's adapters into ``ctx`` and make their scales (and
    the control vector) its default set; the adapters, by id."""
    loaded = [await ctx.load_lora(path) for path, _ in loras]
    cv = None
    if control_vector is not None:
        path, scale = control_vector
        cv = ctx.load_control_vector(path, scale=scale, layers=layers)
    ctx.set_adapters([(a, s) for a, (_, s) in zip(loaded, loras, strict=True)], control_vector=cv)
    # (Scale 0 is "off": the default set then leaves the adapter out.)
    return loaded


def scaled(
    plain: Sequence[str], pairs: Sequence[Sequence[str]], scale: float
) -> tuple[Scaled, ...]:
    """``--lora FNAME`` (at ``scale``) and ``--lora-scaled FNAME SCALE``."""
    return (*((p, scale) for p in plain), *((p, float(s)) for p, s in pairs))


def one_control_vector(plain: Sequence[str], pairs: Sequence[Sequence[str]]) -> Scaled | None:
    """The ``--control-vector`` / ``--control-vector-scaled`` given, if any."""
    given = scaled(plain, pairs, 1.0)
    if len(given) > 1:
        raise ValueError("one control vector at most (--control-vector / --control-vector-scaled)")
    return given[0] if given else None


def request_set(
    ctx: Context, loras: Sequence[Lora], wanted: tuple[tuple[int, float], ...] | None
) -> Adapters:
    """The set a request runs under: the default, or the adapters its
    ``lora`` field names (ids checked against those loaded)."""
    default = ctx.adapters
    if wanted is None:
        return default
    for i, _ in wanted:
        if i >= len(loras):
            raise ApiError(f"lora id {i} is not loaded (the server has {len(loras)})", param="lora")
    pairs = tuple((loras[i], s) for i, s in wanted if s != 0.0)
    return Adapters(pairs, default.control_vector)


def listing(ctx: Context, loras: Sequence[Lora]) -> list[dict[str, Any]]:
    scales = {a: s for a, s in ctx.adapters.loras}
    return [{"id": i, "path": a.path, "scale": scales.get(a, 0.0)} for i, a in enumerate(loras)]


async def lora_adapters(request: Request, ctx: Context, loras: Sequence[Lora]) -> Response:
    """``GET``: the adapters with their default scales; ``POST`` a list of
    ``{"id", "scale"}``: new default scales (adapters left out are off)."""
    if request.method == "POST":
        body = parse_json(await request.body())
        if not isinstance(body, list):  # null included: lora_field takes it for "the default set"
            raise ApiError('the body must be a list of {"id", "scale"}', param="body")
        wanted = lora_field(body, param="body")
        assert wanted is not None
        ctx.set_adapters(
            list(request_set(ctx, loras, wanted).loras), control_vector=ctx.adapters.control_vector
        )
    return JSONResponse(listing(ctx, loras))
