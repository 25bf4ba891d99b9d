"""A pytest plugin (loaded by the root conftest.py): what the docstring
examples need, and a check of which lloyal is under test.

Fixtures in a plugin apply everywhere, also to the doctests of an installed
lloyal that `make test-wheel` collects from site-packages (a conftest's
fixtures only reach tests below its directory).
"""

from __future__ import annotations

import os
from pathlib import Path

import lloyal
import pytest

SOURCE = Path(__file__).resolve().parent.parent / "python" / "lloyal"


@pytest.fixture(autouse=True)
def _doctest_model(doctest_namespace: dict[str, object]) -> None:
    # Docstring examples name the default test model as MODEL.
    from lloyal.models import model_path

    doctest_namespace["MODEL"] = str(model_path("smollm2"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``deterministic_first`` open ``deterministic=True``
    contexts in this process, which must come before anything in it decodes
    (llama.cpp reads GGML_CPU_TILED_MM once): they run first, whatever the
    files given or their order."""
    items.sort(key=lambda item: item.get_closest_marker("deterministic_first") is None)


def pytest_report_header() -> str:
    info = lloyal.backend_info()
    build = f"wheel, CPU variant {info.cpu_variant}" if info.dynamic_backends else "source build"
    return f"lloyal {lloyal.__version__} from {Path(lloyal.__file__).parent} ({build})"


def pytest_sessionstart(session: pytest.Session) -> None:
    # `make test-wheel` must test the installed wheel, never this checkout.
    if os.environ.get("LLOYAL_TEST_WHEEL") == "1":
        here = Path(lloyal.__file__).resolve().parent
        if here == SOURCE or not lloyal.backend_info().dynamic_backends:
            raise pytest.UsageError(f"LLOYAL_TEST_WHEEL=1 but lloyal comes from {here}")
