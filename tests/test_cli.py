"""The command line, run as a user would run it."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

from lloyal import LLAMA_CPP_2_VERSION, __version__, backend_info, create_context

from tests._hang import HANG_GUARD_S
from tests.conftest import COUNTING, Greedy, greedy_reference


def lloyal(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lloyal", *args],
        input=input,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )


def test_generate_streams_text_and_prints_a_summary() -> None:
    result = lloyal(
        "generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0"
    )
    assert result.returncode == 0, result.stderr
    # One route, but host-dependent logits: " Paris" leads by 2.5 logits, over
    # ROUTE_NOISE (tests/conftest.py), so every host picks it.
    assert "Paris" in result.stdout
    assert "tok/s" in result.stderr
    assert "perplexity" in result.stderr


def test_generate_chat_with_gemma_needs_and_takes_a_template(gemma3: Path) -> None:
    no_template = lloyal("generate", "Hi", "--chat", "--model", str(gemma3), "--max-tokens", "2")
    assert no_template.returncode == 1
    assert "no chat template" in no_template.stderr
    ok = lloyal(
        "generate",
        "Hi",
        "--chat",
        "--template",
        "gemma",
        "--model",
        str(gemma3),
        "--max-tokens",
        "4",
        "--seed",
        "1",
    )
    assert ok.returncode == 0, ok.stderr


def test_info_prints_metadata(gemma3: Path) -> None:
    result = lloyal("info", "--model", str(gemma3))
    assert result.returncode == 0, result.stderr
    assert "gemma3" in result.stdout
    assert "no (base model)" in result.stdout


def test_bad_input_exits_non_zero(tmp_path: Path) -> None:
    missing = lloyal("generate", "x", "--model", str(tmp_path / "none.gguf"))
    assert missing.returncode == 1
    assert "not found" in missing.stderr
    bogus = tmp_path / "bogus.gguf"
    bogus.write_text("nope")
    assert lloyal("info", "--model", str(bogus)).returncode == 1
    assert lloyal("generate", "x", "--max-tokens", "-1").returncode == 2
    assert lloyal("generate", "x", "--top-p", "7").returncode == 1
    assert lloyal("bogus-command").returncode == 2


def test_best_of_n_prints_the_winner_and_every_candidate() -> None:
    result = lloyal("best-of-n", "Once upon a time", "-n", "2", "--max-tokens", "4", "--seed", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert result.stderr.count("perplexity") == 2
    assert "* [" in result.stderr
    assert "\r" not in result.stderr  # no progress line when stderr is not a terminal


def test_beam_with_width_1_is_generate_at_temperature_0() -> None:
    beam = lloyal("beam", "The capital of France is", "--width", "1", "--max-tokens", "4")
    assert beam.returncode == 0, beam.stderr
    # Same route, so the same bits: a fresh context each, the prompt in one
    # decode, then one token per decode into the same cells.
    greedy = lloyal(
        "generate", "The capital of France is", "--max-tokens", "4",
        "--temperature", "0", "--repeat-penalty", "1",
    )  # fmt: skip
    assert beam.stdout.strip() == greedy.stdout.strip()
    assert "log p" in beam.stderr


def test_speculative_reports_acceptance_and_compares(smollm2: Path) -> None:
    result = lloyal(
        "speculative", COUNTING["smollm2"], "--max-tokens", "6", "--compare",
        "--draft", str(smollm2), "-k", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "accepted" in result.stderr
    assert "speed-up" in result.stderr
    # Speculative and plain decoding are different routes: the same text only
    # without near-ties, which this prompt's margins rule out (tests/conftest.py).
    greedy = asyncio.run(reference(smollm2, COUNTING["smollm2"], 6))
    assert greedy.all_sure, greedy.margins
    assert "the same text" in result.stderr
    lookup = lloyal("speculative", "1, 2, 3, 1, 2, 3, 1, 2, 3,", "--max-tokens", "4")
    assert lookup.returncode == 0, lookup.stderr
    assert "0 draft decode calls" in lookup.stderr


async def reference(model: Path, prompt: str, max_tokens: int) -> Greedy:
    async with await create_context(model, n_ctx=256) as ctx:
        return await greedy_reference(ctx, prompt, max_tokens)


def test_chat_reads_turns_from_stdin() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lloyal", "chat", "--max-tokens", "4", "--seed", "0", "--verbose"],
        input="Hi!\nWho are you?\n",
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip().splitlines()) == 2
    assert result.stderr.count("new prompt tokens") == 2


def test_strategy_commands_reject_bad_input() -> None:
    assert lloyal("best-of-n", "x", "-n", "0").returncode == 1
    assert lloyal("beam", "x", "--width", "0").returncode == 1
    assert lloyal("speculative", "x", "-k", "0").returncode == 1


def test_embed_prints_similarities_and_json() -> None:
    result = lloyal("embed", "A cat sat on the mat.", "A kitten sat on a rug.", "Tax law.")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[-3:]]
    sims = [[float(x) for x in row[1:]] for row in rows]
    assert abs(sims[0][0] - 1.0) < 1e-3
    assert sims[0][1] > sims[0][2]
    as_json = lloyal("embed", "--json", input="one\ntwo\n")
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert [d["text"] for d in data] == ["one", "two"]
    assert len(data[0]["embedding"]) > 100
    empty = lloyal("embed", input="")
    assert empty.returncode == 2


def test_version_flag() -> None:
    result = lloyal("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (f"lloyal {__version__} (llama-cpp-2 {LLAMA_CPP_2_VERSION})")


def test_info_prints_the_build_and_the_model(smollm2: Path) -> None:
    result = lloyal("info", "--model", str(smollm2), "--n-ctx", "256")
    assert result.returncode == 0, result.stderr
    info = backend_info()
    assert re.search(rf"^cpu variant\s+{re.escape(info.cpu_variant or '-')}$", result.stdout, re.M)
    assert re.search(r"^architecture\s+llama$", result.stdout, re.M)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in result.stdout
    if not info.gpu_backends:
        assert re.search(r"^gpu layers \(auto\)\s+0 \(no GPU\)$", result.stdout, re.M)
