"""Scripts that leave things open at exit (run by test_exit.py and
bench/exit.py): each must end with status 0, however the interpreter's
shutdown races the engine's worker threads.

Usage: python exit_child.py SCENARIO MODEL_PATH
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import lloyal

# tests/_hang.py, from this file's own folder (sys.path[0] when run as a
# script; pytest's collection puts the folder on sys.path too).
from _hang import HANG_GUARD_S

MODEL = ""  # set by main(): the module is imported by pytest's collection too
_kept: list[object] = []


async def context() -> None:
    """A context opened in ``asyncio.run`` and never closed."""
    await lloyal.create_context(MODEL, n_ctx=256)


async def native() -> None:
    """The context's native handle outlives its Python object (as when a
    worker lets go of a finished future without the GIL): nothing in
    Python knows to close it at exit."""
    ctx = await lloyal.create_context(MODEL, n_ctx=256)
    _kept.append(ctx._native)


async def branches() -> None:
    """Branches and a fork left open, a prefill still running when the
    loop ends."""
    ctx = await lloyal.create_context(MODEL, n_ctx=512, n_seq_max=4)
    root = lloyal.Branch.create(ctx, lloyal.GREEDY)
    await root.prefill(ctx.tokenize_sync("The capital of France is"))
    child = await root.fork()
    _kept.append(asyncio.ensure_future(child.prefill(ctx.tokenize_sync(" Paris," * 30))))
    await asyncio.sleep(0)


async def session() -> None:
    """A chat session (and its context) left open mid-conversation."""
    ctx = await lloyal.create_context(MODEL, n_ctx=512)
    chat = await lloyal.Session.create(ctx, params=lloyal.GREEDY)
    await chat.add_user("Say hello.")
    await chat.reply(max_tokens=2)


def server() -> None:
    """``lloyal serve``'s app running in a daemon thread when the main
    thread ends, after answering a request."""
    import httpx
    import uvicorn
    from lloyal.server import ServerConfig, create_app

    app = create_app(ServerConfig(model_path=MODEL, n_seq_max=2, n_ctx=512))
    # asyncio's own loop: uvloop's, in a daemon thread, can take the GIL
    # from a C callback after the interpreter has finalized (a segfault in
    # about 3 exits of 100; uvloop and CPython, whatever the app runs).
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", loop="asyncio")
    srv = uvicorn.Server(config)
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    (sock,) = srv.servers[0].sockets
    port = sock.getsockname()[1]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == 200, r.text


async def trio_context() -> None:
    """A context opened under trio and never closed."""
    _kept.append(await lloyal.create_context(MODEL, n_ctx=256))


def main() -> None:
    global MODEL
    scenario, MODEL = sys.argv[1], sys.argv[2]
    if scenario == "server":
        server()
    elif scenario == "trio":
        import trio

        trio.run(trio_context)
    else:
        asyncio.run(globals()[scenario]())
    print("ok", flush=True)


if __name__ == "__main__":
    main()
