"""Inputs that used to kill the process (issue 14): forged model files,
states and handles, hostile templates and grammars, misuse across contexts.

Each risky case runs in a child interpreter first, so a regression shows up
as a failed assertion on its exit status and stderr instead of taking the
whole test run down; the in-process tests then check that the context and
every other branch stay usable. docs/limits.md lists what each input raises.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import lloyal
import pytest

pytestmark = pytest.mark.anyio


def run_child(code: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter; it must exit 0 (not by a signal)
    and print nothing to stderr that looks like an abort."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
    for fatal in ("GGML_ASSERT", "Fatal Python error", "Segmentation fault", "Aborted"):
        assert fatal not in proc.stderr, proc.stderr[-4000:]
    return proc


def patched_copy(src: Path, dst: Path, key: bytes, value: int) -> Path:
    """Copy a GGUF file with the u32 value of metadata `key` replaced."""
    data = bytearray(src.read_bytes())
    at = data.find(key)
    assert at > 0, key
    value_at = at + len(key) + 4  # after the key bytes and the u32 type tag
    assert int.from_bytes(data[at + len(key) : value_at], "little") == 4  # GGUF u32
    data[value_at : value_at + 4] = value.to_bytes(4, "little")
    dst.write_bytes(bytes(data))
    return dst


# -- forged and odd model files -------------------------------------------


@pytest.mark.parametrize("layers", [0, 513, 2**32 - 1])
def test_forged_block_count_is_refused_before_llama_cpp(
    model: Path, model_name: str, layers: int, tmp_path: Path
) -> None:
    """llama.cpp asserts 1 <= block_count <= 512 while loading (an abort):
    the GGUF header is checked first."""
    arch = {"smollm2": b"llama", "gemma3": b"gemma3"}[model_name]
    forged = patched_copy(model, tmp_path / "forged.gguf", arch + b".block_count", layers)
    out = run_child(
        """
        import asyncio, sys, lloyal
        try:
            asyncio.run(lloyal.create_context(sys.argv[1], n_ctx=256))
        except lloyal.ModelLoadError as e:
            print("refused:", e)
        """,
        str(forged),
    )
    assert f"block_count is {layers}" in out.stdout, out.stdout


async def test_forged_metadata_count_is_refused(smollm2: Path, tmp_path: Path) -> None:
    data = bytearray(smollm2.read_bytes()[: 1 << 20])
    data[16:24] = (2**62).to_bytes(8, "little")  # the metadata entry count
    forged = tmp_path / "count.gguf"
    forged.write_bytes(bytes(data))
    with pytest.raises(lloyal.ModelLoadError, match="more than the file can hold"):
        await lloyal.create_context(forged)


async def test_directory_as_model_path(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match="directory"):
        await lloyal.create_context(tmp_path)


async def test_model_at_a_non_utf8_path(smollm2: Path, tmp_path: Path) -> None:
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/mod\xe9le.gguf"))
    try:
        os.symlink(smollm2, odd)
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system does not take non-UTF-8 names")
    async with await lloyal.create_context(odd, n_ctx=256) as ctx:
        assert ctx.model_info.n_layer == 30
        assert await ctx.tokenize("hi", add_special=False)
    shutil.rmtree(tmp_path)


# -- options bounded before llama.cpp allocates ----------------------------


async def test_n_ctx_beyond_memory_is_a_memory_error_with_the_bytes(model: Path) -> None:
    """The KV cache for 10**9 cells is checked against available memory
    before llama.cpp allocates anything (it used to take ~4 GiB, then fail
    with "null reference")."""
    with pytest.raises(MemoryError, match=r"n_ctx=1000000000 cells needs [0-9.]+ TiB"):
        await lloyal.create_context(model, n_ctx=10**9)
    async with await lloyal.create_context(model, n_ctx=256) as ctx:
        await ctx.decode(await ctx.tokenize("still fine"), 0)


# -- forged states -----------------------------------------------------------


def reframe(state: bytes, payload_at: int, cell: int, pos: int) -> bytes:
    """`state` with the position of cell `cell` of the (first) llama.cpp
    cache set to `pos`, and the checksum recomputed: a forgery that passes
    the frame checks. `payload_at` is where llama.cpp's bytes start in the
    frame's body."""
    header, body = bytearray(state[:24]), bytearray(state[24:])
    # llama.cpp's magic and seq id, n_stream, n_cells, then (pos, n_seq, seq)
    # per cell
    at = payload_at + 16 + cell * 12
    body[at : at + 4] = pos.to_bytes(4, "little", signed=True)
    header[20:24] = zlib.crc32(body).to_bytes(4, "little")
    return bytes(header + body)


FORGED_POSITIONS = [-5, 2**31 - 2, 1 << 30]


async def test_forged_positions_in_a_flat_state_are_refused(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256, n_seq_max=2) as ctx:
        tokens = await ctx.tokenize("The quick brown fox")
        await ctx.decode(tokens, 0, 0)
        state = await ctx.kv_cache_save(0, tokens)
        await ctx.decode(tokens[:3], 0, 1)  # what seq 1 holds before the load
        for pos in FORGED_POSITIONS:
            forged = reframe(state, 8 + 4 * len(tokens), 1, pos)
            with pytest.raises(lloyal.StateError, match=f"position {pos}"):
                await ctx.kv_cache_load(1, forged)
            assert ctx.kv_seq_pos_max(1) == 2  # untouched
        duplicate = reframe(state, 8 + 4 * len(tokens), 1, 0)
        with pytest.raises(lloyal.StateError, match="position 0 twice"):
            await ctx.kv_cache_load(1, duplicate)
        # The genuine state still loads, and decoding continues from it.
        assert await ctx.kv_cache_load(1, state) == tokens
        await ctx.decode(await ctx.tokenize(" jumps", add_special=False), len(tokens), 1)


async def test_forged_positions_in_a_branch_snapshot_are_refused(model: Path) -> None:
    async with await lloyal.create_context(model, n_ctx=256, n_seq_max=3) as ctx:
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await b.prefill(await ctx.tokenize("The quick brown fox"))
        snapshot = await b.save()
        # Body: token count (0), then the branch payload: logits count and
        # logits, then llama.cpp's bytes.
        n_logits = int.from_bytes(snapshot[24 + 8 : 24 + 16], "little")
        for pos in FORGED_POSITIONS:
            forged = reframe(snapshot, 8 + 8 + 4 * n_logits, 0, pos)
            with pytest.raises(lloyal.StateError, match=f"position {pos}"):
                await lloyal.Branch.restore(ctx, forged, lloyal.GREEDY)
        again = await lloyal.Branch.restore(ctx, snapshot, lloyal.GREEDY)
        assert again.position == b.position
        assert (await again.produce()).token == (await b.produce()).token
        await again.prune()
        await b.prune()
