"""Fuzz `lloyal serve`'s request schemas for a while (default 600 s).

Starts a server and sends it random bodies built field by field from each
API's schema with any JSON value in any field (tests/server_fuzz.py; the
test suite runs the same fuzzers for about a minute each), each followed by
a good request that must succeed. Every response must be a success or a 4xx
with the API's JSON error body, and every KV lease must be back after each.
Prints the responses counted by status after each batch of examples.
``--surface``: ``openai`` (/v1/chat/completions and /v1/completions, the
default), ``responses``, ``ollama``, ``anthropic``, ``llama``
(llama-server's /completion) or ``all``.

    python bench/fuzz_server.py [--duration 600] [--surface all] [--model smollm2]

Exits 1, with the (shrunk) body that broke the contract, on any 5xx, any
good request that failed, or a lease that did not come back.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lloyal.models import KNOWN_MODELS, model_path

from tests import server_fuzz

SURFACES = {
    "openai": server_fuzz.requests,
    "responses": server_fuzz.responses_requests,
    "ollama": server_fuzz.ollama_requests,
    "anthropic": server_fuzz.anthropic_requests,
    "llama": server_fuzz.llama_requests,
    "all": server_fuzz.every_surface,
}


def batch(fuzzer: server_fuzz.Fuzzer, examples: int, surface: str) -> None:
    """One hypothesis run of ``examples`` bodies (a fresh random seed each)."""

    @settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(sent=SURFACES[surface]())
    def run(sent: tuple[str, bytes]) -> None:
        fuzzer.round(sent)

    run()


def summary(counts: Counter[int], seconds: float) -> str:
    total = sum(counts.values())
    shares = "  ".join(f"{status}: {n} ({n / total:.0%})" for status, n in sorted(counts.items()))
    return f"{total} fuzzed requests in {seconds:.0f} s ({total / seconds:.1f}/s)  {shares}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds to fuzz")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--n-seq-max", type=int, default=8)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=100, help="examples per hypothesis run")
    parser.add_argument("--surface", choices=sorted(SURFACES), default="openai")
    args = parser.parse_args()
    path = model_path(args.model) if args.model in KNOWN_MODELS else Path(args.model)
    proc, url = server_fuzz.start_server(
        "--model", str(path), "--n-seq-max", str(args.n_seq_max), "--n-ctx", str(args.n_ctx)
    )
    failure: BaseException | None = None
    started = time.monotonic()
    fuzzer = server_fuzz.Fuzzer(url, args.n_seq_max)
    try:
        with fuzzer:
            while time.monotonic() - started < args.duration:
                try:
                    batch(fuzzer, args.batch, args.surface)
                except Exception as e:  # the contract broken: report it below
                    failure = e
                    break
                print(summary(fuzzer.counts, time.monotonic() - started), flush=True)
    finally:
        server_fuzz.stop_server(proc)
    print(summary(fuzzer.counts, time.monotonic() - started))
    if failure is not None:
        print(f"FAILED: {type(failure).__name__}: {failure}", file=sys.stderr)
        for note in getattr(failure, "__notes__", []):
            print(note, file=sys.stderr)
        return 1
    print("passed: no 5xx, every good request succeeded, every lease came back")
    return 0


if __name__ == "__main__":
    sys.exit(main())
