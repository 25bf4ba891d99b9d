"""lloyal: forkable decode state for local LLMs.

An asyncio-native Python library over llama.cpp with a Rust core. You write
the decode loop; lloyal gives you the control surface -- tokens, positions,
KV sequences, logits, sampling, entropy and perplexity -- without blocking
the event loop. Works under asyncio, uvloop and trio (via anyio).

>>> import asyncio, lloyal
>>> async def main():
...     async with await lloyal.create_context(MODEL) as ctx:
...         tokens = await ctx.tokenize("Once upon a time")
...         await ctx.decode(tokens, 0)
...         return ctx.model_entropy("bits") > 0
>>> asyncio.run(main())
True
"""

from lloyal._generation import Generation, GenerationStep
from lloyal._lloyal import PerplexityTracker, supports_gpu_offload
from lloyal._lloyal import __version__ as __version__
from lloyal.adapters import Adapters, ControlVector, Lora
from lloyal.backend import LLAMA_CPP_2_VERSION, BackendInfo, Device, backend_info
from lloyal.branch import Branch, BranchStore, Produced, Token, TokenTree
from lloyal.chat.budget import ReasoningBudget
from lloyal.chat.output import (
    CHAT_FORMATS,
    ChatOutput,
    ChatOutputStream,
    ToolCall,
    parse_chat_output,
)
from lloyal.context import (
    BUILTIN_CHAT_TEMPLATES,
    ChatPrompt,
    Context,
    ContextStats,
    ModelInfo,
    create_context,
    fit_gpu_layers,
)
from lloyal.errors import (
    AdapterLoadError,
    BranchBusyError,
    BranchDisposedError,
    ChatTemplateError,
    ChecksumMismatchError,
    ContextClosedError,
    DecodeError,
    GrammarError,
    InternalError,
    KVCacheFullError,
    LloyalError,
    MediaError,
    ModelLoadError,
    NoLeaseError,
    ProjectorLoadError,
    PullError,
    PullNotFoundError,
    StateError,
    WorkerLostError,
)
from lloyal.grammar import Grammar, json_schema_to_grammar
from lloyal.media import MEDIA_MARKER, Media, ProjectorInfo
from lloyal.prefix_cache import PrefixCache, PrefixCacheStats
from lloyal.programs import (
    Program,
    ProgramState,
    Turn,
    assistant,
    program,
    run_batch,
    system,
    user,
)
from lloyal.rerank import Rerank
from lloyal.sampling import GREEDY, SamplingParams
from lloyal.session import Session
from lloyal.text import TextStream

__all__ = [
    "BUILTIN_CHAT_TEMPLATES",
    "CHAT_FORMATS",
    "GREEDY",
    "LLAMA_CPP_2_VERSION",
    "MEDIA_MARKER",
    "AdapterLoadError",
    "Adapters",
    "BackendInfo",
    "Branch",
    "BranchBusyError",
    "BranchDisposedError",
    "BranchStore",
    "ChatOutput",
    "ChatOutputStream",
    "ChatPrompt",
    "ChatTemplateError",
    "ChecksumMismatchError",
    "Context",
    "ContextClosedError",
    "ContextStats",
    "ControlVector",
    "DecodeError",
    "Device",
    "Generation",
    "GenerationStep",
    "Grammar",
    "GrammarError",
    "InternalError",
    "KVCacheFullError",
    "LloyalError",
    "Lora",
    "Media",
    "MediaError",
    "ModelInfo",
    "ModelLoadError",
    "NoLeaseError",
    "PerplexityTracker",
    "PrefixCache",
    "PrefixCacheStats",
    "Produced",
    "Program",
    "ProgramState",
    "ProjectorInfo",
    "ProjectorLoadError",
    "PullError",
    "PullNotFoundError",
    "ReasoningBudget",
    "Rerank",
    "SamplingParams",
    "Session",
    "StateError",
    "TextStream",
    "Token",
    "TokenTree",
    "ToolCall",
    "Turn",
    "WorkerLostError",
    "assistant",
    "backend_info",
    "create_context",
    "fit_gpu_layers",
    "json_schema_to_grammar",
    "parse_chat_output",
    "program",
    "run_batch",
    "supports_gpu_offload",
    "system",
    "user",
]
