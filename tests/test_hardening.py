"""Inputs that used to kill the process (issue 14): forged model files,
states and handles, hostile templates and grammars, misuse across contexts.

Each risky case runs in a child interpreter first, so a regression shows up
as a failed assertion on its exit status and stderr instead of taking the
whole test run down; the in-process tests then check that the context and
every other branch stay usable. docs/limits.md lists what each input raises.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import lloyal
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._hang import HANG_GUARD_S

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    """These tests are about inputs, not event loops: asyncio only (the
    loop-specific paths have their own suites)."""
    return "asyncio"


def run_child(
    code: str, *args: str, timeout: float = HANG_GUARD_S
) -> subprocess.CompletedProcess[str]:
    """Run `code` in a fresh interpreter; it must exit 0 (not by a signal)
    and print nothing to stderr that looks like an abort. ``timeout`` is a
    hang guard (tests/_hang.py)."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    tail = proc.stderr[-4000:]
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{tail}"
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


async def test_model_at_a_non_ascii_path_with_spaces(smollm2: Path, tmp_path: Path) -> None:
    """Folders and names beyond ASCII, with spaces (on Windows also a drive
    letter and backslashes: the path as the OS writes it)."""
    folder = tmp_path / "modèles de test ☃"
    folder.mkdir()
    odd = folder / "petit modèle ☃.gguf"
    try:
        os.link(smollm2, odd)
    except OSError:
        shutil.copyfile(smollm2, odd)
    async with await lloyal.create_context(str(odd), n_ctx=256) as ctx:
        assert ctx.model_info.n_layer == 30
        assert await ctx.tokenize("hi", add_special=False)
    with pytest.raises(FileNotFoundError):
        await lloyal.create_context(folder / "absent ☃.gguf")


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


async def test_more_threads_than_cpus_is_a_warning(smollm2: Path) -> None:
    # The CPUs this process may run on: its affinity where the OS has one.
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with pytest.warns(RuntimeWarning, match=f"more than the {cpus} CPUs"):
        ctx = await lloyal.create_context(smollm2, n_ctx=256, n_threads=cpus + 1)
    async with ctx:
        assert ctx.n_threads == cpus + 1
        await ctx.decode(await ctx.tokenize("fine"), 0)


async def test_n_batch_below_n_seq_max_is_raised_not_an_abort(model: Path) -> None:
    """llama.cpp reserves an output row per sequence within n_batch and
    asserted when n_batch < n_seq_max (found by the property test below)."""
    async with await lloyal.create_context(model, n_ctx=256, n_batch=2, n_seq_max=4) as ctx:
        assert ctx.n_batch == 4
        await ctx.decode(await ctx.tokenize("hello world, again and again"), 0)
    with pytest.raises(ValueError, match=r"n_seq_max \(75\) must be <= n_ctx \(42\)"):
        await lloyal.create_context(model, n_ctx=42, n_seq_max=75)


# -- ownership: handles, contexts, leases ------------------------------------


async def test_a_store_refuses_another_contexts_branch(model: Path) -> None:
    """Handles used to be bare slot numbers: context A's store advanced A's
    own branch with the same handle, and retain_only pruned A's branches."""
    async with (
        await lloyal.create_context(model, n_ctx=256, n_seq_max=2) as a,
        await lloyal.create_context(model, n_ctx=256, n_seq_max=2) as b,
    ):
        prompt = await a.tokenize("The quick brown fox")
        mine = lloyal.Branch.create(a, lloyal.GREEDY)
        theirs = lloyal.Branch.create(b, lloyal.GREEDY)
        await mine.prefill(prompt)
        await theirs.prefill(prompt)
        assert mine._id & 0xFFFF == theirs._id & 0xFFFF  # same slot
        store = lloyal.BranchStore(a)
        token = (await theirs.produce()).token
        with pytest.raises(ValueError, match="another context"):
            await store.commit([(theirs, token)])
        with pytest.raises(ValueError, match="another context"):
            await store.prefill([(theirs, [token])])
        with pytest.raises(ValueError, match="another context"):
            await store.retain_only(theirs)
        # Natively too: the branch's id names its context.
        with pytest.raises(ValueError, match="another context"):
            a._native.branch_logprobs_many([(theirs, token)], 0)
        assert mine.position == theirs.position == len(prompt)
        assert not mine.disposed
        assert not theirs.disposed
        await store.commit([(mine, token)])
        assert mine.position == len(prompt) + 1


async def test_a_branch_of_a_closed_context_raises(model: Path) -> None:
    ctx = await lloyal.create_context(model, n_ctx=256, n_seq_max=2)
    b = lloyal.Branch.create(ctx, lloyal.GREEDY)
    await b.prefill(await ctx.tokenize("Hello"))
    await ctx.aclose()
    assert b.disposed
    for read in (lambda: b.position, lambda: b.perplexity, lambda: b.logits):
        with pytest.raises(lloyal.ContextClosedError):
            read()
    with pytest.raises(lloyal.ContextClosedError):
        await b.commit(5)
    with pytest.raises(lloyal.ContextClosedError):
        await b.produce()


async def test_a_branch_never_takes_the_flat_apis_sequence(smollm2: Path) -> None:
    """Branch.create used to lease (and wipe) a sequence the flat API had
    decoded into; now it takes another one, or raises."""
    async with await lloyal.create_context(smollm2, n_ctx=256, n_seq_max=2) as ctx:
        flat = await ctx.tokenize("The flat loop owns sequence one.")
        await ctx.decode(flat, 0, 1)  # the sequence a branch would take first
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        assert ctx.kv_seq_pos_max(1) == len(flat) - 1
        store = lloyal.BranchStore(ctx)
        assert store.available == 0  # seq 0 is b's, seq 1 the flat API's
        with pytest.raises(lloyal.NoLeaseError, match="flat API"):
            lloyal.Branch.create(ctx, lloyal.GREEDY)
        await b.prefill(await ctx.tokenize("A branch"))
        with pytest.raises(lloyal.NoLeaseError, match="flat API"):
            await b.fork()
        assert ctx.kv_seq_pos_max(1) == len(flat) - 1  # nothing lost
        await ctx.kv_cache_remove(1, 0)
        assert store.available == 1
        child = await b.fork()
        assert child.position == b.position


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ctx, b: lloyal.Branch.create(None), "ctx must be a lloyal.Context"),  # type: ignore[arg-type]
        (lambda ctx, b: lloyal.Branch.create(ctx, 5), "params must be a lloyal.SamplingParams"),  # type: ignore[arg-type]
        (lambda ctx, b: lloyal.BranchStore("ctx"), "ctx must be a lloyal.Context"),  # type: ignore[arg-type]
        (lambda ctx, b: lloyal.SamplingParams(temperature="hot"), "temperature must be a float"),  # type: ignore[arg-type]
        (lambda ctx, b: lloyal.SamplingParams(top_k=2.5), "top_k must be an int"),  # type: ignore[arg-type]
        (lambda ctx, b: b.steer([1, 2]), "biases must be a mapping"),  # type: ignore[arg-type]
        (lambda ctx, b: b.set_sampler_params({}), "params must be a lloyal.SamplingParams"),  # type: ignore[arg-type]
        (lambda ctx, b: ctx.sample("greedy"), "params must be a lloyal.SamplingParams"),  # type: ignore[arg-type]
    ],
)
def test_wrong_types_are_type_errors_naming_the_parameter(
    shared_ctx: lloyal.Context, call: Any, message: str
) -> None:
    b = lloyal.Branch.create(shared_ctx, lloyal.GREEDY)
    try:
        with pytest.raises(TypeError, match=message):
            call(shared_ctx, b)
    finally:
        asyncio.run(b.prune())


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ctx, b: ctx.decode([1], "0"), "pos must be an int"),
        (lambda ctx, b: ctx.decode([1], 0, "0"), "seq_id must be an int"),
        (lambda ctx, b: ctx.decode(7, 0), "tokens must be a sequence"),
        (lambda ctx, b: ctx.tokenize(b"bytes"), "text must be a str"),
        (lambda ctx, b: b.prefill("text"), "not text"),
        (lambda ctx, b: b.commit("5"), "token ids must be integers"),
        (lambda ctx, b: lloyal.BranchStore(ctx).commit([b]), r"items\[0\] must be a \(Branch"),
        (
            lambda ctx, b: lloyal.BranchStore(ctx).retain_only(None),
            "winner must be a lloyal.Branch",
        ),
        (lambda ctx, b: lloyal.Branch.restore(ctx, "state"), "data must be bytes"),
        (
            lambda ctx, b: lloyal.create_context(ctx.model_info.path, n_ctx="4096"),
            "n_ctx must be an int",
        ),
    ],
)
async def test_wrong_types_in_coroutines(model: Path, call: Any, message: str) -> None:
    async with await lloyal.create_context(model, n_ctx=256, n_seq_max=2) as ctx:
        b = lloyal.Branch.create(ctx, lloyal.GREEDY)
        await b.prefill(await ctx.tokenize("Hello"))
        with pytest.raises(TypeError, match=message):
            await call(ctx, b)
        await b.commit((await b.produce()).token)  # still usable
        await b.prune()


def test_closing_with_unpruned_branches_keeps_rss_flat(smollm2: Path, gemma3: Path) -> None:
    """Closing a context frees every branch's native state; a closed context
    used to keep ~10 MiB (its model's tables) until the garbage collector
    broke a reference cycle through the branch registry. 200 cycles of
    create / Branch.create / prefill / close, never pruning (fewer for the
    larger Gemma 3, which takes 0.5 s a cycle)."""
    out = run_child(
        """
        import asyncio, sys, lloyal

        def rss_mib():
            return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

        async def cycles(path, n):
            for i in range(n):
                ctx = await lloyal.create_context(path, n_ctx=256, n_seq_max=2)
                b = lloyal.Branch.create(ctx, lloyal.GREEDY)
                await b.prefill(await ctx.tokenize("hello"))
                if i % 2:
                    ctx.close()
                else:
                    await ctx.aclose()
                if i == 9:
                    base = rss_mib()
            return rss_mib() - base

        for path, n in ((sys.argv[1], 200), (sys.argv[2], 40)):
            print(f"{asyncio.run(cycles(path, n)):.1f}")
        """,
        str(smollm2),
        str(gemma3),
    )
    growth = [float(x) for x in out.stdout.split()]
    assert len(growth) == 2
    assert all(g < 50 for g in growth), growth  # it was ~9 MiB a cycle


# -- chat templates: bounded parse and render, without the GIL ---------------

CHAINS = [
    "{{ a" + ".b" * 100_000 + " }}",
    "{{ 1" + " + 1" * 100_000 + " }}",
    "{{ x" + "|e" * 100_000 + " }}",
    "{{ " + "-" * 100_000 + "1 }}",
    "{{ " + "not " * 100_000 + "1 }}",
]


def test_deep_template_expressions_are_refused_not_a_stack_overflow(smollm2: Path) -> None:
    """These overflowed the stack in minijinja's compiler (SIGSEGV)."""
    out = run_child(
        """
        import asyncio, sys, lloyal
        from lloyal._lloyal import validate_chat_template
        chains = [
            "{{ a" + ".b" * 100_000 + " }}",
            "{{ 1" + " + 1" * 100_000 + " }}",
            "{{ x" + "|e" * 100_000 + " }}",
            "{{ " + "-" * 100_000 + "1 }}",
            "{{ " + "not " * 100_000 + "1 }}",
        ]
        ctx = asyncio.run(lloyal.create_context(sys.argv[1], n_ctx=256))
        for source in chains:
            print(validate_chat_template(source))
            try:
                ctx.format_chat([{"role": "user", "content": "hi"}], template=source)
            except lloyal.ChatTemplateError as e:
                print("refused:", e)
        print(ctx.format_chat([{"role": "user", "content": "hi"}]).prompt.count("hi"))
        ctx.close()
        """,
        str(smollm2),
    )
    lines = out.stdout.splitlines()
    assert lines.count("False") == len(CHAINS)
    assert sum("tokens; at most 2000" in line for line in lines) == len(CHAINS)
    assert lines[-1] == "1"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "fuel",
        ),
        ("{% for i in range(100000) %}{{ 'a' * 1000 }}{% endfor %}", "exceed 67108864 bytes"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion limit"),
        ("{{ 'a' * 2147483648 }}", "failed to render"),
        ("x" * (1 << 20) + "x", "at most 1048576"),
    ],
)
def test_costly_templates_hit_a_limit(
    shared_ctx: lloyal.Context, template: str, message: str
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(lloyal.ChatTemplateError, match=message):
        shared_ctx.format_chat(messages, template=template)
    assert "hi" in shared_ctx.format_chat(messages, template="chatml").prompt


def test_a_string_doubled_in_a_loop_is_refused_before_it_grows_large(
    shared_ctx: lloyal.Context,
) -> None:
    """Each doubling is charged to the render's fuel before it allocates,
    and the fuel buys 256 MiB of strings in all: a string doubled to
    256 MiB (512 MiB built on the way) is refused. With the fuel at
    20,000,000 it rendered, and doubling on to 2^40 peaked at 1.4 GiB
    before the refusal (issue 48)."""
    doubled = (
        "{% set ns = namespace(s='ab') %}{% for i in range(27) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}"
    )
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(lloyal.ChatTemplateError, match="fuel"):
        shared_ctx.format_chat(messages, template=doubled)
    # Half as far (a 1 MiB string) is an ordinary render.
    half = doubled.replace("range(27)", "range(19)")
    assert shared_ctx.format_chat(messages, template=half).prompt == str(2 << 19)


def test_a_template_renders_without_holding_the_gil(shared_ctx: lloyal.Context) -> None:
    """A render that runs until its fuel is spent used to freeze every
    Python thread; now the others run meanwhile."""
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    ticks = 0
    done = threading.Event()

    def other_thread() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0.001)

    worker = threading.Thread(target=other_thread)
    worker.start()
    try:
        with pytest.raises(lloyal.ChatTemplateError, match="fuel"):
            shared_ctx.format_chat([{"role": "user", "content": "hi"}], template=spin)
    finally:
        done.set()
        worker.join()
    # Not a speed check: the GIL-bound version gave 0-1 ticks. The render
    # spends a fixed amount of fuel (~0.5 s idle), and a busy machine slows
    # it as much as the ticking thread, so a few ticks always fit.
    assert ticks >= 3


# -- grammars: bounded translation and compilation ---------------------------


def test_deep_and_long_grammars_are_refused_or_compiled_not_a_crash(
    model: Path,
) -> None:
    """GBNF nested 20,000 deep overflowed the translator's stack, and a
    chain of 5,000 rules (GBNF or Lark) llguidance's compiler's (SIGSEGV)."""
    out = run_child(
        """
        import asyncio, sys, lloyal

        n = 20_000
        cases = {
            "nest": dict(grammar="root ::= " + "(" * n + '"a"' + ")" * n),
            "gbnf-chain": dict(grammar="root ::= r0\\n"
                + "".join(f"r{i} ::= r{i + 1}\\n" for i in range(5000)) + 'r5000 ::= "a"\\n'),
            "lark-chain": dict(lark="start: r0\\n"
                + "".join(f"r{i}: r{i + 1}\\n" for i in range(5000)) + 'r5000: "a"\\n'),
            "too-big": dict(lark="start: r0\\n"
                + "".join(f"r{i}: r{i + 1}\\n" for i in range(50000)) + 'r50000: "a"\\n'),
        }

        async def main():
            async with await lloyal.create_context(sys.argv[1], n_ctx=256, n_seq_max=2) as ctx:
                for name, spec in cases.items():
                    try:
                        b = lloyal.Branch.create(ctx, lloyal.GREEDY, **spec)
                    except lloyal.GrammarError as e:
                        print(name, "refused:", str(e).splitlines()[0])
                        continue
                    await b.prefill(await ctx.tokenize("Say a:"))
                    print(name, "compiled:", repr((await b.produce()).text))
                    await b.prune()

        asyncio.run(main())
        """,
        str(model),
    )
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert "nest more than 30 deep" in lines["nest"]
    assert lines["gbnf-chain"] == "compiled: 'a'"
    assert lines["lark-chain"] == "compiled: 'a'"
    assert "at most 524288 are accepted" in lines["too-big"]


# -- one context, two event loops in two threads ------------------------------


def test_two_event_loops_in_two_threads_share_a_context(smollm2: Path) -> None:
    """Concurrent commits from two loops used to share one commit queue:
    one loop's flush raced the other's append and a commit was never sent
    (3 runs of 3 hung). Each thread now batches its own."""
    out = run_child(
        """
        import asyncio, sys, threading, lloyal

        ctx = asyncio.run(lloyal.create_context(sys.argv[1], n_ctx=2048, n_seq_max=4))
        results = {}

        def drive(name):
            async def main():
                b = lloyal.Branch.create(ctx, lloyal.GREEDY)
                await b.prefill(await ctx.tokenize("Once upon a time"))
                for _ in range(200):
                    await b.commit((await b.produce()).token)
                position = b.position
                await b.prune()
                return position

            try:
                # A hang guard (tests/_hang.py): a thread that hangs says so.
                results[name] = asyncio.run(asyncio.wait_for(main(), float(sys.argv[2])))
            except BaseException as e:
                results[name] = repr(e)

        threads = [threading.Thread(target=drive, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(results["a"], results["b"])
        ctx.close()
        """,
        str(smollm2),
        str(HANG_GUARD_S),
        # Past the threads' own guard, whose report names the one that hung.
        timeout=2 * HANG_GUARD_S,
    )
    prompt = len(asyncio.run(_tokenize(smollm2, "Once upon a time")))
    assert out.stdout.split() == [str(prompt + 200)] * 2, out.stdout


async def _tokenize(path: Path, text: str) -> list[int]:
    async with await lloyal.create_context(path, n_ctx=256) as ctx:
        return await ctx.tokenize(text)


# -- property tests: options, grammars, templates ----------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_ctx=st.one_of(st.integers(-5, 20), st.integers(20, 5000), st.just(10**9)),
    n_batch=st.one_of(st.integers(-1, 3), st.integers(1, 5000), st.just(10**9)),
    n_seq_max=st.integers(-1, 300),
    n_threads=st.one_of(st.none(), st.integers(-1, 3), st.just(600)),
    embeddings=st.booleans(),
)
def test_any_options_give_a_working_context_or_a_clear_error(
    smollm2: Path, n_ctx: int, n_batch: int, n_seq_max: int, n_threads: int | None, embeddings: bool
) -> None:
    async def attempt() -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # n_threads > CPUs
                ctx = await lloyal.create_context(
                    smollm2,
                    n_ctx=n_ctx,
                    n_batch=n_batch,
                    n_seq_max=n_seq_max,
                    n_threads=n_threads,
                    embeddings=embeddings,
                )
        except (ValueError, MemoryError):
            return
        async with ctx:
            assert 1 <= ctx.n_batch <= ctx.n_ctx
            text = "The river ran past the mill. " * 4
            if embeddings:
                if len(await ctx.tokenize(text)) > ctx.n_batch:
                    with pytest.raises(ValueError, match="does not fit one batch"):
                        await ctx.embed([text])
                    return
                vectors = await ctx.embed([text])
                assert vectors.shape == (1, ctx.embedding_dim)
            else:
                tokens = await ctx.tokenize(text * 20)
                fits = tokens[: ctx.n_ctx - 8]
                await ctx.decode(fits, 0)  # split at n_batch, never an abort
                assert ctx.kv_seq_pos_max(0) == len(fits) - 1

    asyncio.run(attempt())


GBNF_PIECES = ['"a"', '"b"', "[a-c]", "[^x]", ".", "r1", "(", ")", "|", "*", "+", "?", "{1,2}", " "]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.lists(st.sampled_from(GBNF_PIECES), min_size=1, max_size=30),
    helper=st.lists(st.sampled_from(GBNF_PIECES), min_size=0, max_size=10),
)
def test_random_gbnf_compiles_or_is_a_grammar_error(
    shared_ctx: lloyal.Context, body: list[str], helper: list[str]
) -> None:
    rule = "".join(helper) or '"z"'
    grammar = "root ::= " + "".join(body) + "\nr1 ::= " + rule + "\n"
    try:
        b = lloyal.Branch.create(shared_ctx, lloyal.GREEDY, grammar=grammar)
    except lloyal.GrammarError:
        return
    asyncio.run(b.prune())


JINJA_PIECES = [
    "{{ ",
    " }}",
    "{% if ",
    " %}",
    "{% endif %}",
    "{% for m in messages %}",
    "{% endfor %}",
    "m.content",
    "m.role",
    "|trim",
    "~",
    "'x'",
    "(",
    ")",
    "+",
    "1",
    "not ",
    "[",
    "]",
    "text",
    "\n",
]


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(st.sampled_from(JINJA_PIECES), max_size=40))
def test_random_templates_render_or_are_a_template_error(
    shared_ctx: lloyal.Context, pieces: list[str]
) -> None:
    try:
        rendered = shared_ctx.format_chat(
            [{"role": "user", "content": "hi"}], template="".join(pieces)
        )
    except lloyal.ChatTemplateError:
        return
    assert rendered.template_source == "custom"
