"""Argument type checks shared by the public API: a wrong type is a
``TypeError`` that names the parameter, raised before anything runs."""

from __future__ import annotations

import operator
from typing import Any


def type_name(value: object) -> str:
    return type(value).__name__


def integer(value: Any, name: str) -> int:
    """``value`` as an int (anything with ``__index__``; not a bool)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type_name(value)}") from None


def instance(value: Any, cls: type, name: str, what: str) -> None:
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {what}, got {type_name(value)}")
