"""Scripts that leave contexts, branches, sessions or a server open exit
cleanly (issue 27, family 6): each scenario of exit_child.py runs in a
fresh interpreter, a few times, since the hang it guards against was a
race (a context a worker's reply kept alive without the GIL hung 30-50% of
exits; one whose native handle outlived its Python object hung every
time). ``bench/exit.py`` runs them 100 times each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests._hang import HANG_GUARD_S

CHILD = Path(__file__).with_name("exit_child.py")
SCENARIOS = ["context", "native", "branches", "session", "server", "trio"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_script_that_leaves_things_open_exits(scenario: str, smollm2: Path) -> None:
    for _ in range(3):
        # A hang guard, not a speed limit: a run takes a few seconds (most
        # of it loading the model) and a hung exit never ends.
        done = subprocess.run(
            [sys.executable, str(CHILD), scenario, str(smollm2)],
            capture_output=True,
            text=True,
            timeout=HANG_GUARD_S,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "ok", done.stderr
