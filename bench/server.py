"""lloyal serve against llama.cpp's llama-server and llama-cpp-python's server.

Each server gets the same model and the same load: C concurrent clients
(default 1, 8 and 32), each sending R chat completions one after another
(a shared system prompt and a question of its own), every answer exactly
``--max-tokens`` tokens long (end-of-generation tokens are banned with
``logit_bias``, a field all three servers take, so nobody wins by stopping
early). Every request streams (SSE). Printed per server and concurrency:
aggregate completion tokens per second, p50 and p99 request latency, p50
time to first token, p50 and p99 inter-token latency (the gaps between a
request's streamed chunks), and the ratio of lloyal's tokens/s to the
other server's (the median over rounds in which the servers took turns at
the same concurrency), all from one run.

    python bench/server.py                       # SmolLM2, all servers found or built
    python bench/server.py --clients 1,8 --servers lloyal,llama-server
    python bench/server.py --model gemma3 --clients 1,8,32,64 --servers lloyal,llama-server
    python bench/server.py --workload echo --servers lloyal,lloyal-spec --clients 1,4
    python bench/server.py --workload agents --servers lloyal,llama-server --rounds 1
    python bench/server.py --clients 8 --servers lloyal,lloyal@/tmp/old/python

``lloyal@PATH`` runs ``lloyal serve`` with the package at ``PATH`` first on
``PYTHONPATH`` (the ``python/`` folder of another checkout, a git worktree
of an earlier commit say, with this build's extension copied into its
``lloyal/``): lloyal against an earlier version of itself, in one run.

``--workload agents`` is an agent framework's load: 32 clients (unless
``--clients`` says), each a conversation of ``--requests`` turns (3 by
default) under one system prompt of about 1,500 tokens that defines the
agents' tools, shared by every client; each turn sends the conversation so
far (its earlier questions and the answers it streamed) and a new question.
lloyal forks the shared prompt's cells; llama-server's slots each hold and
compute their own. Every server gets 2,048 KV cells per slot for it, and
lloyal's prefix cache one entry per client (``--cache-branches``, with the
sequences it needs), as llama-server's slots each keep their conversation.

``--workload echo`` asks each request to copy a passage (greedy, the answer
as long as the model makes it, counted from ``usage``): the load where
speculative decoding pays. ``lloyal-spec`` is ``lloyal serve --spec
prompt-lookup``; its ratio column is then lloyal (plain) over it, so the
speed-up is its inverse (printed too).

Where the other servers come from:

- ``llama-server``: ``$LLAMA_SERVER`` or ``llama-server`` on PATH, else
  built with cmake from the llama.cpp that llama-cpp-python's source
  package vendors (the llama-cpp-2 crate we build on ships llama.cpp
  without the server's sources, so *the same* llama.cpp is not available;
  the version built is printed). Slots = clients' maximum (``-np``),
  continuous batching on.
- ``llama-cpp-python``: its ``[server]`` extra in ``~/.cache/lloyal/bench-venv``
  (built for this CPU the first time; several minutes). It serves one
  request at a time.

Both builds are cached under ``~/.cache/lloyal``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lloyal
from _common import CMAKE_NO_AMX, llama_cpp_python
from lloyal.models import model_path

CACHE = Path.home() / ".cache" / "lloyal"
SYSTEM = "You are a concise assistant. Answer in one or two sentences. " * 3
# The echo workload's passages: each request copies one.
PASSAGE = (
    "The river rises in the hills above the town and runs south through the old mill, "
    "under the stone bridge, past the church and the market square, and out across the "
    "meadows to the sea. In spring it floods the lower fields; in summer children swim "
    "in the pool below the weir; in autumn the leaves of the plane trees drift on it."
)

# The agents workload's tools: a system prompt of about 1,500 tokens
# (SmolLM2's tokenizer; Gemma's is within a few percent).
_TOOLS = [
    (
        "search_web",
        "Search the web and return the ten best results with titles and snippets.",
        {"query": "string", "site": "string, optional", "recent_days": "integer, optional"},
    ),
    (
        "fetch_page",
        "Download a web page and return its readable text, without markup.",
        {"url": "string", "max_chars": "integer, optional"},
    ),
    (
        "read_file",
        "Read a file of the project workspace and return its text.",
        {"path": "string", "offset": "integer, optional", "limit": "integer, optional"},
    ),
    (
        "write_file",
        "Create or overwrite a file of the project workspace.",
        {"path": "string", "content": "string"},
    ),
    (
        "list_dir",
        "List the entries of a folder of the workspace, with sizes.",
        {"path": "string", "recursive": "boolean, optional"},
    ),
    (
        "run_shell",
        "Run a shell command in the workspace and return its output and exit status.",
        {"command": "string", "timeout_s": "integer, optional"},
    ),
    (
        "query_sql",
        "Run a read-only SQL query against the analytics database.",
        {"sql": "string", "max_rows": "integer, optional"},
    ),
    (
        "send_email",
        "Send an email from the team's shared address.",
        {"to": "string", "subject": "string", "body": "string", "cc": "string, optional"},
    ),
    (
        "calendar_find",
        "Find free slots shared by several people's calendars.",
        {"people": "array of strings", "duration_min": "integer", "within_days": "integer"},
    ),
    (
        "calendar_book",
        "Book a meeting in a slot found by calendar_find.",
        {"slot_id": "string", "title": "string", "agenda": "string, optional"},
    ),
    (
        "weather",
        "The weather forecast for a place, by day.",
        {"place": "string", "days": "integer, optional"},
    ),
    (
        "convert_units",
        "Convert a quantity between units of length, mass, volume or temperature.",
        {"value": "number", "from_unit": "string", "to_unit": "string"},
    ),
    (
        "translate",
        "Translate a text between two languages.",
        {"text": "string", "source": "string, optional", "target": "string"},
    ),
    (
        "create_ticket",
        "Open a ticket in the issue tracker.",
        {"title": "string", "body": "string", "labels": "array of strings, optional"},
    ),
    (
        "update_ticket",
        "Change a ticket's state, assignee or labels, or comment on it.",
        {"id": "integer", "state": "string, optional", "comment": "string, optional"},
    ),
    (
        "get_stock_quote",
        "The latest price and the day's change of a listed company's stock.",
        {"symbol": "string"},
    ),
    (
        "summarize",
        "Summarize a long text in a given number of sentences.",
        {"text": "string", "sentences": "integer, optional"},
    ),
    (
        "remember",
        "Store a fact in the agent's long-term memory under a key.",
        {"key": "string", "value": "string"},
    ),
    (
        "recall",
        "Look up facts in the agent's long-term memory by key or by meaning.",
        {"key": "string, optional", "about": "string, optional"},
    ),
]
AGENT_SYSTEM = (
    "You are an agent that completes tasks for the user with the tools below. "
    "To call a tool, answer with one JSON object on a line of its own: "
    '{"tool": NAME, "arguments": {...}}, then wait for its result. Call one '
    "tool at a time, check each result before the next step, never invent a "
    "result, and when the task is done, answer in plain words. Ask the user "
    "when a request is ambiguous. Keep answers short.\n\nTools:\n"
    + "\n".join(
        json.dumps(
            {
                "name": name,
                "description": what,
                "parameters": {
                    "type": "object",
                    "properties": {k: {"type": v.split(",")[0]} for k, v in args.items()},
                    "required": [k for k, v in args.items() if "optional" not in v],
                },
            }
        )
        for name, what, args in _TOOLS
    )
)
AGENT_TASKS = [
    "Find a free hour next week for Ana, Bo and Chen and book a design review.",
    "What will the weather be in Lisbon on Friday, in Fahrenheit?",
    "Open a ticket for the failing nightly build and assign it to me.",
    "Summarize the README of the workspace in three sentences.",
]


@dataclass
class Result:
    server: str
    clients: int
    tokens: int
    seconds: float
    latencies: list[float]
    first: list[float]
    gaps: list[float]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def pct(self, q: float, xs: list[float] | None = None) -> float:
        xs = sorted(self.latencies if xs is None else xs)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server() -> tuple[Path, str]:
    """A llama-server binary and a label for its llama.cpp."""
    found = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if found:
        return Path(found), "llama-server (found)"
    src = CACHE / "llama-server-src"
    binary = src / "build" / "bin" / "llama-server"
    if not binary.exists():
        print("building llama-server (several minutes)", file=sys.stderr)
        src.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                # Its source, not a wheel; its build tools (cmake, ninja)
                # as wheels (":all:" would compile those from source too).
                "--no-binary",
                "llama-cpp-python",
                "llama-cpp-python",
                "-d",
                str(src),
            ],
            check=True,
        )
        archive = next(src.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
        tree = next(src.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = src / "build"
        subprocess.run(
            [
                "cmake",
                "-S",
                str(tree),
                "-B",
                str(build),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_NATIVE=ON",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_SERVER=ON",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                *CMAKE_NO_AMX,
            ],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count())],
            check=True,
            capture_output=True,  # compiler warnings by the thousand
        )
    version = next(src.glob("llama_cpp_python-*")).name.removeprefix("llama_cpp_python-")
    return binary, f"llama-server (llama.cpp of llama-cpp-python {version})"


def start(
    kind: str,
    model: Path,
    port: int,
    slots: int,
    threads: int,
    template: str | None,
    per_slot: int = 256,
    extra: list[str] | None = None,
) -> subprocess.Popen[bytes]:
    # "lloyal@PATH": lloyal serve with the package of another checkout.
    kind, _, source = kind.partition("@")
    env = {**os.environ, "PYTHONPATH": source} if source else None
    if kind in ("lloyal", "lloyal-spec"):
        cmd = [
            sys.executable,
            "-m",
            "lloyal",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            # One sequence more than slots: the prefix cache keeps one;
            # with long conversations (agents), one per slot, as
            # llama-server's slots each keep their own.
            "--n-seq-max",
            str(slots + 1 if per_slot <= 256 else 2 * slots + 1),
            "--n-ctx",
            str(per_slot * (slots + 1)),
            "--threads",
            str(threads),
        ]
    elif kind == "llama-server":
        binary, _ = llama_server()
        cmd = [
            str(binary),
            "-m",
            str(model),
            "--port",
            str(port),
            "-np",
            str(slots),
            "-c",
            str(per_slot * slots),
            "-t",
            str(threads),
            "--cont-batching",
        ]
        if template:
            # A built-in template's name: with Jinja on (llama-server's
            # default) the name itself would be taken as the template's
            # source, and every prompt would render as that word.
            cmd += ["--no-jinja", "--chat-template", template]
    else:
        python = llama_cpp_python("[server]")
        cmd = [
            str(python),
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--port",
            str(port),
            "--n_ctx",
            "2048",
            "--n_threads",
            str(threads),
        ]
        if template:
            cmd += ["--chat_format", template]
    if kind == "lloyal-spec":
        cmd += ["--spec", "prompt-lookup"]
    if kind in ("lloyal", "lloyal-spec") and template:
        cmd += ["--template", template]
    if kind in ("lloyal", "lloyal-spec"):
        if per_slot > 256:
            cmd += ["--cache-branches", str(slots)]
        cmd += extra or []
    # Each server's output goes to a log of its own (a server that dies
    # says why there).
    name = kind + ("-" + Path(source).parent.name if source else "")
    log = open(CACHE / f"bench-{name}.log", "wb")  # noqa: SIM115 - the server's whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{kind} did not start")


@dataclass
class Load:
    tokens: int
    seconds: float
    latencies: list[float]
    first: list[float]
    gaps: list[float]


def _body(
    workload: str,
    i: int,
    j: int,
    max_tokens: int,
    banned: dict[str, float],
    history: list[dict[str, str]],
) -> dict:
    if workload == "agents":
        task = AGENT_TASKS[i % len(AGENT_TASKS)]
        question = f"Task {i}: {task}" if j == 0 else f"Turn {j}: go on with task {i}."
        return {
            "model": "m",
            "messages": [
                {"role": "system", "content": AGENT_SYSTEM},
                *history,
                {"role": "user", "content": question},
            ],
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "seed": i * 1000 + j,
            "logit_bias": banned,
        }
    if workload == "echo":
        words = PASSAGE.split()
        shift = (i * 7 + j * 3) % len(words)  # each request its own passage
        text = " ".join(words[shift:] + words[:shift])
        return {
            "model": "m",
            "messages": [
                {"role": "user", "content": f"Repeat this text exactly:\n\n{text}"},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Question {i}.{j}: name a city and a colour."},
        ],
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i * 1000 + j,
        "logit_bias": banned,
    }


async def load(
    url: str,
    clients: int,
    requests: int,
    max_tokens: int,
    banned: dict[str, float],
    workload: str = "chat",
) -> Load:
    latencies: list[float] = []
    first: list[float] = []
    gaps: list[float] = []
    tokens = 0

    async def client(i: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens
        # The conversation so far (the agents workload sends it back).
        history: list[dict[str, str]] = []
        for j in range(requests):
            body = {
                **_body(workload, i, j, max_tokens, banned, history),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            t0 = time.perf_counter()
            last: float | None = None
            used: int | None = None
            reply: list[str] = []
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        used = chunk["usage"]["completion_tokens"]
                    choices = chunk.get("choices") or [{}]
                    text = (choices[0].get("delta") or {}).get("content")
                    if not text:
                        continue
                    reply.append(text)
                    now = time.perf_counter()
                    if last is None:
                        first.append(now - t0)
                    else:
                        gaps.append(now - last)
                    last = now
            latencies.append(time.perf_counter() - t0)
            history += [body["messages"][-1], {"role": "assistant", "content": "".join(reply)}]
            # End-of-generation tokens are banned: every answer is max_tokens
            # long, whether or not the server reports usage when streaming.
            tokens += used if used is not None else max_tokens

    # A fresh connection per request: llama-server may close a streamed
    # response's connection just as the client reuses it.
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=fresh) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*[client(i, http) for i in range(clients)])
        return Load(tokens, time.perf_counter() - t0, latencies, first, gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--clients", help="concurrencies (default 1,8,32; agents: 32)")
    parser.add_argument("--requests", type=int, default=3, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--servers",
        default="lloyal,llama-server,llama-cpp-python",
        help="any of lloyal, lloyal-spec (--spec prompt-lookup), llama-server, llama-cpp-python",
    )
    parser.add_argument("--workload", choices=["chat", "echo", "agents"], default="chat")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--lloyal-args", default="", help="more arguments for lloyal serve, e.g. '--step-tokens 64'"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="turns per server at each concurrency"
    )
    parser.add_argument(
        "--template",
        help="chat template name for models without one (gemma3: gemma; "
        "each server's own built-in of that name)",
    )
    args = parser.parse_args()
    model = Path(args.model) if Path(args.model).exists() else model_path(args.model)
    clients = args.clients or ("32" if args.workload == "agents" else "1,8,32")
    counts = [int(c) for c in clients.split(",")]
    # KV cells per slot: a conversation under the agents' long system prompt.
    per_slot = 2048 if args.workload == "agents" else 256
    slots = max(counts)

    async def end_tokens() -> dict[str, float]:
        async with await lloyal.create_context(model, n_ctx=256) as ctx:
            return {str(t): -100.0 for t in range(ctx.vocab_size) if ctx.is_stop_token(t)}

    banned = asyncio.run(end_tokens())
    labels = {
        "lloyal": f"lloyal {lloyal.__version__}",
        "lloyal-spec": f"lloyal {lloyal.__version__} --spec prompt-lookup",
        "llama-cpp-python": "llama-cpp-python server",
    }
    # Every server runs for the whole bench; at each concurrency they take
    # turns, ROUNDS times, in alternating order, so that the swings of a
    # shared machine hit all of them alike. The ratio is the median over
    # rounds of lloyal's tok/s over the other's in the same round.
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    template = args.template or ("gemma" if "gemma" in model.name.lower() else None)
    for kind in args.servers.split(","):
        if "@" in kind:
            labels[kind] = f"lloyal from {kind.partition('@')[2]}"
        try:
            if kind == "llama-server":
                labels[kind] = llama_server()[1]
            port = _free_port()
            servers[kind] = (
                start(
                    kind,
                    model,
                    port,
                    slots,
                    args.threads,
                    template,
                    per_slot,
                    args.lloyal_args.split(),
                ),
                f"http://127.0.0.1:{port}",
            )
        except (subprocess.CalledProcessError, RuntimeError, StopIteration, OSError) as e:
            print(f"{kind}: not run ({e})", file=sys.stderr)
    runs: dict[tuple[str, int], list[Load]] = {}
    try:
        for _, url in servers.values():
            asyncio.run(load(url, 1, 1, 4, banned, args.workload))  # warm up
        for c in counts:
            for r in range(args.rounds):
                kinds = list(servers) if r % 2 == 0 else list(reversed(servers))
                for kind in kinds:
                    got = asyncio.run(
                        load(
                            servers[kind][1],
                            c,
                            args.requests,
                            args.max_tokens,
                            banned,
                            args.workload,
                        )
                    )
                    runs.setdefault((kind, c), []).append(got)
                    print(
                        f"{kind:>16} clients={c:<3} round {r} "
                        f"{got.tokens / got.seconds:8.1f} tok/s",
                        file=sys.stderr,
                    )
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    results: list[Result] = []
    ratios: dict[tuple[str, int], float] = {}
    spread: dict[tuple[str, int], tuple[float, float]] = {}
    for (kind, c), loads in runs.items():
        results.append(
            Result(
                kind,
                c,
                sum(x.tokens for x in loads),
                sum(x.seconds for x in loads),
                [t for x in loads for t in x.latencies],
                [t for x in loads for t in x.first],
                [t for x in loads for t in x.gaps],
            )
        )
        mine = runs.get(("lloyal", c), [])
        paired = sorted(
            (a.tokens / a.seconds) / (b.tokens / b.seconds)
            for a, b in zip(mine, loads, strict=False)
        )
        ratios[kind, c] = statistics.median(paired) if paired else float("nan")
        spread[kind, c] = (paired[0], paired[-1]) if paired else (float("nan"),) * 2
    print(
        f"\nmodel: {model.name}; {args.workload} workload; {args.requests} requests per client, "
        f"{args.max_tokens} tokens each; {args.threads} threads; {args.rounds} rounds, "
        "servers taking turns (tok/s: all rounds; ratio: median of the rounds' ratios, "
        "with their min and max)"
    )
    for kind, label in labels.items():
        if any(r.server == kind for r in results):
            print(f"  {kind}: {label}")
    print(
        "\n| server | clients | tok/s | p50 s | p99 s | TTFT p50 ms | ITL p50 ms | ITL p99 ms "
        "| lloyal / this | rounds' min-max |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    order = list(servers)
    for r in sorted(results, key=lambda r: (order.index(r.server), r.clients)):
        ratio = ratios[r.server, r.clients]
        print(
            f"| {r.server} | {r.clients} | {r.tok_s:.1f} | {r.pct(0.5):.2f} | {r.pct(0.99):.2f} "
            f"| {1000 * r.pct(0.5, r.first):.0f} | {1000 * r.pct(0.5, r.gaps):.1f} "
            f"| {1000 * r.pct(0.99, r.gaps):.1f} | {ratio:.2f}x "
            f"| {spread[r.server, r.clients][0]:.2f}-{spread[r.server, r.clients][1]:.2f} |"
        )
    for c in counts:
        if ("lloyal-spec", c) in ratios and ("lloyal", c) in runs:
            print(
                f"\n--spec prompt-lookup at {c} clients: {1 / ratios['lloyal-spec', c]:.2f}x tok/s"
            )


if __name__ == "__main__":
    main()
