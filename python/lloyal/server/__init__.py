"""An OpenAI-compatible HTTP server on lloyal (``pip install lloyal[server]``).

``lloyal serve --model model.gguf`` serves ``/v1/chat/completions`` and
``/v1/completions`` (streaming as server-sent events, ``n`` choices as
forks of one prompt, ``logprobs``, ``tools`` / ``tool_calls``,
``response_format`` JSON schemas, ``stop``, ``seed``), ``/v1/embeddings``,
``/v1/models``, ``/health`` and ``/metrics``. It is written on the public
API only. One step loop drives every running choice of every request: each
produces a token, and all of them are committed in one
``BranchStore.commit``, so a step costs one decode however many requests
run. Prompts go through a :class:`lloyal.PrefixCache`, and a new prompt's
prefill shares decodes with the running commits. KV sequences and cells
bound the work admitted, requests past ``max_queue`` waiting get 429, and a
client that disconnects frees its branches. See ``docs/server.md``.
"""

from __future__ import annotations

from lloyal.server._app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app", "serve"]


def serve(config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Run the server with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(create_app(config), host=host, port=port, log_level="warning")
