"""The server's configuration and the state its routes share."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from lloyal.context import Context, create_context
from lloyal.server._engine import Scheduler

DEFAULT_STEP_TOKENS = 128
"""The server's step budget (``--step-tokens``): a step of streams and
prompt chunks costs at most about this many tokens' decode, so a new
request's prompt delays the running streams' next token by about the time
of this many tokens (docs/server.md has the measurements)."""


@dataclass(frozen=True)
class ServerConfig:
    """How :func:`create_app` opens its models (see ``lloyal serve --help``).

    One model is ``model_path`` (named ``model_name``, else the GGUF's own
    name); several are ``models``, ``(name, path)`` pairs, opened on first
    use, at most ``models_max`` at once, each closed after ``keep_alive``
    idle seconds (None: never), and within ``models_memory`` bytes. The
    other fields apply to each model.
    """

    model_path: str | os.PathLike[str] | None = None
    model_name: str | None = None
    models: tuple[tuple[str, str | os.PathLike[str]], ...] = ()
    models_max: int | None = None
    # Bytes the open models may take (weights and KV caches); None: no limit.
    models_memory: int | None = None
    keep_alive: float | None = None
    template: str | None = None
    n_ctx: int = 8192
    n_seq_max: int = 32
    n_threads: int | None = None
    # The most tokens a step decodes (Context.step_tokens): the streams'
    # commits, then prompt chunks; None: n_batch.
    step_tokens: int | None = DEFAULT_STEP_TOKENS
    prefix_cache: bool = True
    cache_branches: int | None = None
    cache_dir: str | os.PathLike[str] | None = None
    max_queue: int = 64
    embeddings: bool = True
    # Adapters (``lloyal.server._adapters``): LoRA files with their default
    # scales, ids in this order; a control vector with its scale and layers.
    loras: tuple[tuple[str | os.PathLike[str], float], ...] = ()
    control_vector: tuple[str | os.PathLike[str], float] | None = None
    control_vector_layers: tuple[int, int] | None = None
    # Tokens of reasoning before the end-of-thinking marker is forced (-1:
    # no limit); a request's reasoning_budget overrides it.
    reasoning_budget: int = -1
    # Where a reply's reasoning goes, unless a request says: "auto" /
    # "deepseek" (reasoning_content) or "none" (left in the content).
    reasoning_format: str = "auto"
    # create_context(deterministic=True): a request's tokens are the same
    # bits whatever it is batched with (docs/determinism.md).
    deterministic: bool = False
    # A projector (mmproj GGUF): requests may hold images and audio.
    mmproj: str | os.PathLike[str] | None = None
    # Speculation in the step loop: "prompt-lookup" or None; the most
    # drafts a round verifies (``lloyal.server._speculation``).
    spec: str | None = None
    spec_k: int = 8
    # A draft model (same vocabulary) that drafts instead of prompt lookup.
    draft_model: str | os.PathLike[str] | None = None
    # Context shift: prompts over the context are cut, replies that reach
    # its end reseeded (BlinkKV), keeping the first n_keep tokens.
    ctx_shift: bool = False
    n_keep: int = 4
    # Keys a request must carry (``lloyal.server._auth``); none: open.
    api_keys: tuple[str, ...] = ()
    # Origins whose browser pages may call the server (CORS); "*": any;
    # none: no CORS headers, and a preflight is a 405.
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        served = self.served()
        if not served:
            raise ValueError("a server needs a model: model_path or models")
        names = [name for name, _ in served]
        if len(set(names)) != len(names):
            raise ValueError(f"two models have the same name: {names}")
        several = len(served) > 1
        per_model = (
            self.loras
            or self.control_vector is not None
            or self.mmproj is not None
            or self.draft_model is not None
        )
        if several and per_model:
            raise ValueError(
                "adapters, projectors and draft models are for one model: serve several without"
            )
        if self.models_memory is not None and self.models_memory < 1:
            raise ValueError(f"models_memory must be positive bytes, not {self.models_memory}")
        if self.models_max is not None and self.models_max < 1:
            raise ValueError(f"models_max must be at least 1, not {self.models_max}")
        if self.spec not in (None, "prompt-lookup"):
            raise ValueError(f"spec must be 'prompt-lookup' or None, not {self.spec!r}")
        if not 1 <= self.spec_k <= 32:
            raise ValueError(f"spec_k must be in [1, 32], not {self.spec_k}")
        if self.step_tokens is not None and self.step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1 (or None), not {self.step_tokens}")
        if self.n_keep < 0:
            raise ValueError(f"n_keep must be >= 0, not {self.n_keep}")
        if self.keep_alive is not None and self.keep_alive <= 0:
            raise ValueError(f"keep_alive must be positive seconds, not {self.keep_alive}")

    def served(self) -> list[tuple[str, ServerConfig]]:
        """Each model's name and config (its own ``model_path`` and
        ``model_name``; no ``models``)."""
        pairs = list(self.models)
        if self.model_path is not None:
            if not pairs:
                return [(self.model_name or "default", self)]
            pairs.insert(0, (self.model_name or Path(self.model_path).stem, self.model_path))
        return [
            (name, dataclasses.replace(self, model_path=path, model_name=name, models=()))
            for name, path in pairs
        ]


class State:
    """The server's model, engine and caches, shared by its routes."""

    def __init__(self, config: ServerConfig, ctx: Context, draft: Context | None = None) -> None:
        self.config = config
        self.ctx = ctx
        self.draft = draft
        self._token_info: dict[int, tuple[str, list[int]]] = {}
        self.engine = Scheduler(
            ctx,
            prefix_cache=config.prefix_cache,
            cache_branches=config.cache_branches,
            cache_dir=config.cache_dir,
            max_queue=config.max_queue,
            spec_k=config.spec_k if config.spec or draft is not None else 0,
            draft=draft,
            ctx_shift=config.ctx_shift,
            n_keep=config.n_keep,
            step_tokens=config.step_tokens,
        )
        self.name = config.model_name or ctx.model_info.name or "lloyal"
        self._embedder: Context | None = None
        # A reranker's pooling context scores query-document pairs rather
        # than embedding.
        self.reranker = ctx.is_reranker
        self._embed_lock = asyncio.Lock()

    def token_info(self, token: int) -> tuple[str, list[int]]:
        """A token's text and bytes for logprobs, asked of the model once
        per token (a step's logprobs then cost no native call per entry)."""
        info = self._token_info.get(token)
        if info is None:
            info = self._token_info[token] = (
                self.ctx.token_to_text(token),
                list(self.ctx.token_bytes(token)),
            )
        return info

    @property
    def opened_embedder(self) -> Context | None:
        """The pooling context, if a request opened it."""
        return self._embedder

    async def embedder(self) -> Context:
        """A pooling context on the same model, opened on first use (rank
        pooling for a reranker)."""
        async with self._embed_lock:
            if self._embedder is None:
                assert self.config.model_path is not None
                self._embedder = await create_context(
                    self.config.model_path,
                    embeddings=True,
                    pooling="rank" if self.reranker else "mean",
                    deterministic=self.config.deterministic,
                    n_ctx=min(self.config.n_ctx, 4096),
                    n_threads=self.config.n_threads,
                )
            return self._embedder

    async def aclose(self) -> None:
        await self.engine.aclose()
        if self._embedder is not None:
            await self._embedder.aclose()
        if self.draft is not None:
            await self.draft.aclose()
        await self.ctx.aclose()
