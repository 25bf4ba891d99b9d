"""A pytest plugin (loaded by the root conftest.py): on Windows, the tests
that need what Windows or Wine lacks are skipped, each with its reason.

``make test-windows`` runs the suite on python.org's CPython for Windows
under Wine (docs/windows.md); everything not listed here runs there. A
test is listed by the start of its node id (a file, a test, or one of its
parameters), so a new test in a listed file is skipped only when that file
is listed whole. (tests/test_cluster.py skips itself: it imports Ray,
which is not installed there.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Node-id prefixes (or "[param" parts of node ids) and why they are skipped.
SKIPS: dict[str, str] = {
    # Libraries the suite uses that have no Windows build.
    "[uvloop": "uvloop has no Windows build (asyncio's own loops are tested)",
    # POSIX-only mechanisms the tests use to provoke a failure or measure.
    "tests/test_hardening.py::test_model_at_a_non_utf8_path": (
        "Windows paths are UTF-16: there is no non-UTF-8 path to make"
    ),
    "tests/test_hardening.py::test_closing_with_unpruned_branches_keeps_rss_flat": (
        "reads the RSS from /proc/self/statm"
    ),
    "tests/test_examples.py::test_docs_examples_run[cluster": (
        "Ray is not installed under Wine: lloyal.cluster is untested on Windows"
    ),
    "tests/test_prefix_cache.py::test_a_hostile_cache_folder_gives_misses_or_correct_hits": (
        "makes symlinks and a FIFO, which Windows (and Wine) does not have as files"
    ),
}


# What Wine (8, the version make test-windows uses) lacks; these run on a
# real Windows. (trio's base-socket query and Wine's lost socket wake-ups
# have stand-ins instead: scripts/windows/wine-hooks/sitecustomize.py.)
WINE_SKIPS: dict[str, str] = {}


def _under_wine() -> bool:
    import ctypes

    try:
        return hasattr(ctypes.WinDLL("ntdll"), "wine_get_version")  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return False


def _reason(nodeid: str, wine: bool) -> str | None:
    for key, reason in (SKIPS | WINE_SKIPS).items() if wine else SKIPS.items():
        if nodeid.startswith(key) or (key.startswith("[") and key in nodeid):
            return reason
    return None


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    """lloyal.cluster's doctests import Ray, which is not installed under
    Wine (tests/test_cluster.py skips itself with the reason)."""
    if sys.platform == "win32" and collection_path.parent.name == "cluster":
        return collection_path.parent.parent.name == "lloyal" or None
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if sys.platform != "win32":
        return
    wine = _under_wine()
    for item in items:
        reason = _reason(item.nodeid, wine)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"Windows: {reason}"))
