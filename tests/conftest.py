from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import lloyal
import pytest
from lloyal.models import model_path

MODELS = ["smollm2", "gemma3"]


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(params=MODELS)
def model_name(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def model(model_name: str) -> Path:
    return model_path(model_name)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return model_path("smollm2")


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return model_path("gemma3")


def open_sync(path: Path, **kwargs: object) -> lloyal.Context:
    """A context usable from any later event loop (it is loop-agnostic)."""
    return asyncio.run(lloyal.create_context(path, **kwargs))  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=MODELS)
def shared_ctx(request: pytest.FixtureRequest) -> Iterator[lloyal.Context]:
    """One context per model for read-only tests (tokenizer, templates)."""
    ctx = open_sync(model_path(request.param), n_ctx=256)
    yield ctx
    ctx.close()
