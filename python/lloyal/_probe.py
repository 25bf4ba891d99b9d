"""A projector loaded in a probe process first.

libmtmd builds a projector's compute graph when it loads one, and a file
that is well-formed GGUF can still lack a tensor that graph uses, or hold
a size it asserts on (``clip.vision.image_size`` 0): llama.cpp then
dereferences a null tensor or aborts, which no check in this process can
catch once it happens. So before a context loads a projector, a child
process loads it the same way (the text model's vocabulary and sizes
only, :func:`lloyal._lloyal.probe_projector`). A child killed by a signal
or that exits without a word means the file would have killed the
caller: :class:`~lloyal.errors.ProjectorLoadError`, and nothing changes.
A child that refuses the file cleanly leaves the refusal to the real
load, which gives the same typed error. A file that passed is remembered
by path, size and modification time, so it is probed once per process.

The child runs :func:`_main`: it exits 0 when libmtmd loads the projector,
3 when it refuses it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from lloyal.errors import ProjectorLoadError

# A hang guard, not a speed limit: a large projector's graph is built in
# well under a minute on a busy machine.
_TIMEOUT_S = 600.0
_REFUSED = 3
_CHILD = "import sys; from lloyal._probe import _main; sys.exit(_main(sys.argv[1:]))"

_passed: set[tuple[str, str, int, int]] = set()
_lock = threading.Lock()


def check_projector(model_path: str | os.PathLike[str], mmproj: str | os.PathLike[str]) -> None:
    """Raise :class:`ProjectorLoadError` if loading ``mmproj`` for the
    model at ``model_path`` would crash this process (see the module)."""
    path = Path(mmproj)
    try:
        st = path.stat()
    except OSError:
        return  # the real load says what is wrong with the path
    key = (
        os.fspath(Path(model_path).resolve()),
        os.fspath(path.resolve()),
        st.st_size,
        st.st_mtime_ns,
    )
    with _lock:
        if key in _passed:
            return
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, os.fspath(model_path), os.fspath(path)],
            capture_output=True,
            timeout=_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        raise ProjectorLoadError(
            f"{path}: libmtmd did not finish loading it in {_TIMEOUT_S:.0f} s (in a probe process)"
        ) from e
    if done.returncode in (0, _REFUSED):
        if done.returncode == 0:
            with _lock:
                _passed.add(key)
        return
    raise ProjectorLoadError(
        f"{path}: libmtmd {_how(done.returncode)} loading it (in a probe process, so this "
        "one is unharmed): a damaged projector, or a kind this build of llama.cpp does not "
        f"handle{_last_line(done.stderr)}"
    )


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"crashed ({signal.Signals(-code).name})"
        except ValueError:
            return f"crashed (signal {-code})"
    return f"crashed (exit status {code})"


def _last_line(stderr: bytes) -> str:
    lines = [line for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    return f"; it said: {lines[-1].strip()[:300]}" if lines else ""


def _main(argv: list[str]) -> int:
    from lloyal import _lloyal
    from lloyal.errors import LloyalError

    model_path, mmproj = argv
    try:
        _lloyal.probe_projector(model_path, mmproj)
    except (LloyalError, OSError, ValueError) as e:
        print(f"refused: {e}", file=sys.stderr)
        return _REFUSED
    return 0
