"""The one wall-clock limit the tests use: a hang guard.

A test that waits on something (a subprocess, a server starting, an HTTP
reply, a worker's answer, a counter it polls) bounds the wait by
``HANG_GUARD_S`` so that a hang fails the test instead of blocking the run.
It is never a speed check: nothing a test asserts depends on how fast the
machine is, and performance is measured in ``bench/``, not here. It is
generous because a shared or loaded machine (a 2-core host with a load
average of 4-7, ``make test-loaded``) runs 5-10x slower than an idle one;
what it waits for takes seconds there at most.

``LLOYAL_HANG_GUARD`` (seconds) changes it. pytest-timeout's per-test limit
(pyproject.toml) is the outer guard, for waits that have none of their own.
"""

from __future__ import annotations

import os
import time

HANG_GUARD_S = float(os.environ.get("LLOYAL_HANG_GUARD", "600"))


def deadline() -> float:
    """The ``time.monotonic()`` value past which a wait that started now is
    a hang."""
    return time.monotonic() + HANG_GUARD_S
