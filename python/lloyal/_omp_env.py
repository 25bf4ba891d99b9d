"""libgomp's spin count, set for the moment libgomp loads.

llama.cpp's CPU threads are an OpenMP team (libgomp, loaded with
``lloyal._lloyal``). At each barrier of a decode's graph a thread that
waits spins ``GOMP_SPINCOUNT`` times (300,000 by default) before it sleeps.
On an idle machine the spin costs nothing, but when other processes want
the cores it takes the time slice the thread being waited for needs: on
the 2-core machine with two busy processes beside it, a decode of SmolLM2
took 80-430 ms instead of 9. With 1,000 spins (a few microseconds) it
took 20-45 ms there, and decoded about as fast as with the default on the
idle machine; fewer spins (300) cost 10% there, more (3,000) gave back
most of the loss under one busy process (``bench/contention.py``;
``docs/performance.md`` has the numbers). libgomp reads the variable once, when it loads,
so it is set just for the import of the native module and removed again
(child processes do not inherit it). A ``GOMP_SPINCOUNT`` or
``OMP_WAIT_POLICY`` already in the environment is left alone, and so is a
process that loaded libgomp before lloyal (another OpenMP library).
"""

from __future__ import annotations

import os

SPIN_COUNT = "1000"

_ours = "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ
if _ours:
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
try:
    from lloyal import _lloyal  # noqa: F401 - loads libgomp, which reads it now
finally:
    if _ours:
        del os.environ["GOMP_SPINCOUNT"]
