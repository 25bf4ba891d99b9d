"""Shared by the test suite and the docstring examples in python/lloyal."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _doctest_model(doctest_namespace: dict[str, object]) -> None:
    # Docstring examples name the default test model as MODEL.
    from lloyal.models import model_path

    doctest_namespace["MODEL"] = str(model_path("smollm2"))
