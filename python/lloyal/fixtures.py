"""Test artifacts made here from nothing downloaded: adapter files with
random weights of a test model's shapes, written with llama.cpp's own
``gguf`` package (``pip install gguf``; the ``test`` extra has it) and kept
in :func:`lloyal.models.cache_dir` like the test models.

- :func:`lora`: a LoRA for SmolLM2 (or Gemma 3) on every ``attn_q`` and
  ``attn_v``: ``"random"`` changes the model's logits, ``"zero"`` (B = 0)
  leaves them exactly as they are.
- :func:`control_vector`: a ``cvector-generator``-style file with one random
  direction per layer.
- :func:`mmproj`: a projector (llava's "mlp" kind) with a random two-layer
  vision encoder, for 32x32 images of 16 positions, whose output fits the
  model: SmolLM2 (or Gemma 3) becomes a tiny vision-language model.
  ``kind="audio"`` is an audio one instead (Qwen2-Audio's kind: a random
  two-layer Whisper encoder), 750 positions for each 30 s of sound.
  :func:`mmproj_damaged` writes one without some of its tensors or with
  other sizes, for tests that such a file is refused, not a crash.

``python -m lloyal.fixtures`` (``make fixtures``) writes them all and
prints their paths; each is written once, then found in the cache.

>>> from lloyal import fixtures
>>> fixtures.lora("zero").name
'smollm2-lora-zero.gguf'
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from lloyal.models import ModelNotInstalledError, cache_dir, model_path

LoraKind = Literal["random", "zero"]

RANK = 8
ALPHA = 8.0


def _gguf() -> Any:
    try:
        # Optional, and typed only in some versions: keep mypy out of it.
        return importlib.import_module("gguf")
    except ImportError:
        raise ModelNotInstalledError("writing test fixtures needs gguf: pip install gguf") from None


def _write(target: Path, arch: str, fill: Any) -> Path:
    """Write ``target`` (through a temporary file, so that a crash leaves
    no half file in the cache)."""
    gguf = _gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.part")
    writer = gguf.GGUFWriter(partial, arch)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(target)
    return target


@functools.cache
def _shapes(model: str) -> tuple[str, dict[str, tuple[int, ...]]]:
    """The architecture and tensor shapes (innermost first) of a model."""
    reader = _gguf().GGUFReader(model_path(model))
    arch = str(reader.fields["general.architecture"].contents())
    return arch, {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}


def lora(kind: LoraKind = "random", model: str = "smollm2") -> Path:
    """A rank-8 LoRA (alpha 8) for test model ``model`` on every ``attn_q``
    and ``attn_v``: random A and B, or B all zero (``kind="zero"``)."""
    if kind not in ("random", "zero"):
        raise ValueError(f"kind must be 'random' or 'zero', got {kind!r}")
    target = cache_dir() / f"{model}-lora-{kind}.gguf"
    if target.is_file():
        return target
    arch, shapes = _shapes(model)

    def fill(w: Any) -> None:
        w.add_string("general.type", "adapter")
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", ALPHA)
        rng = np.random.default_rng(29)
        for name, ne in sorted(shapes.items()):
            if not name.endswith(("attn_q.weight", "attn_v.weight")):
                continue
            n_in, n_out = ne[0], ne[1]
            # numpy shapes are outermost first: A is (rank, n_in), B (n_out, rank).
            a = rng.normal(0.0, 1.0 / np.sqrt(n_in), (RANK, n_in)).astype(np.float32)
            b = rng.normal(0.0, 0.5, (n_out, RANK)).astype(np.float32)
            w.add_tensor(f"{name}.lora_a", a)
            w.add_tensor(f"{name}.lora_b", b if kind == "random" else np.zeros_like(b))

    return _write(target, arch, fill)


def control_vector(model: str = "smollm2") -> Path:
    """A control vector for test model ``model``: one random direction
    (norm 4) for every layer from 1, as ``cvector-generator`` writes."""
    target = cache_dir() / f"{model}-control-vector.gguf"
    if target.is_file():
        return target
    arch, shapes = _shapes(model)
    n_embd = shapes["token_embd.weight"][0]
    n_layer = 1 + max(int(n.split(".")[1]) for n in shapes if n.startswith("blk."))

    def fill(w: Any) -> None:
        w.add_string("controlvector.model_hint", arch)
        w.add_uint32("controlvector.layer_count", n_layer - 1)
        rng = np.random.default_rng(29)
        for layer in range(1, n_layer):
            v = rng.normal(0.0, 1.0, n_embd).astype(np.float32)
            w.add_tensor(f"direction.{layer}", v * (4.0 / np.linalg.norm(v)))

    return _write(target, "controlvector", fill)


MMPROJ_IMAGE_SIZE = 32
MMPROJ_PATCH = 8


def mmproj(model: str = "smollm2", kind: Literal["vision", "audio"] = "vision") -> Path:
    """A random projector for test model ``model``. Vision: 32x32 RGB
    images in 8x8 patches through two encoder blocks of width 32, then a
    two-layer MLP into the model's embedding width (16 positions an
    image). Audio: 128 mel bins through Whisper's two convolutions and
    two blocks of width 32, then one linear layer (750 positions for each
    30 s of sound)."""
    if kind not in ("vision", "audio"):
        raise ValueError(f"kind must be 'vision' or 'audio', got {kind!r}")
    suffix = "" if kind == "vision" else "-audio"
    target = cache_dir() / f"{model}-mmproj{suffix}.gguf"
    if target.is_file():
        return target
    return _write(target, "clip", _mmproj_fill(model, kind))


def mmproj_damaged(
    target: Path,
    model: str = "smollm2",
    kind: Literal["vision", "audio"] = "vision",
    *,
    drop: Sequence[str] = (),
    values: Mapping[str, int] | None = None,
) -> Path:
    """:func:`mmproj` written to ``target`` without the tensors ``drop``
    and with the uint32 keys ``values`` set to theirs: a damaged projector,
    for tests that it is refused and not a crash. :func:`mmproj_tensors`
    lists what there is to drop."""
    fill = _mmproj_fill(model, kind)
    left: dict[str, int] = dict(values or {})

    class Damaging:
        def __init__(self, writer: Any) -> None:
            self._writer = writer

        def add_tensor(self, name: str, data: Any) -> None:
            if name not in drop:
                self._writer.add_tensor(name, data)

        def add_uint32(self, key: str, value: int) -> None:
            self._writer.add_uint32(key, left.pop(key, value))

        def __getattr__(self, name: str) -> Any:
            return getattr(self._writer, name)

    def damaged(writer: Any) -> None:
        fill(Damaging(writer))
        for key, value in left.items():  # keys the projector did not have
            writer.add_uint32(key, value)

    return _write(Path(target), "clip", damaged)


def mmproj_tensors(
    model: str = "smollm2", kind: Literal["vision", "audio"] = "vision"
) -> list[str]:
    """The names of the tensors of :func:`mmproj`."""
    reader = _gguf().GGUFReader(mmproj(model, kind))
    return [t.name for t in reader.tensors]


def _mmproj_fill(model: str, kind: str) -> Any:
    """What :func:`mmproj` writes, as a function of a GGUF writer."""
    _, shapes = _shapes(model)
    n_text = shapes["token_embd.weight"][0]
    size, patch, width, hidden, blocks = MMPROJ_IMAGE_SIZE, MMPROJ_PATCH, 32, 64, 2
    n_patches = (size // patch) ** 2
    prefix, modality = ("v", "vision") if kind == "vision" else ("a", "audio")

    def fill(w: Any) -> None:
        rng = np.random.default_rng(29)

        def rand(*shape: int, sd: float = 0.1) -> Any:
            return rng.normal(0.0, sd, shape).astype(np.float32)

        w.add_bool(f"clip.has_{modality}_encoder", True)
        w.add_string("clip.projector_type", "mlp" if kind == "vision" else "qwen2a")
        for key, value in (
            ("embedding_length", width),
            ("attention.head_count", 4),
            ("feed_forward_length", hidden),
            ("block_count", blocks),
            ("projection_dim", n_text),
        ):
            w.add_uint32(f"clip.{modality}.{key}", value)
        w.add_float32(f"clip.{modality}.attention.layer_norm_epsilon", 1e-6)
        # numpy shapes, outermost first.
        if kind == "vision":
            w.add_uint32("clip.vision.image_size", size)
            w.add_uint32("clip.vision.patch_size", patch)
            w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
            w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
            w.add_tensor("v.patch_embd.weight", rand(width, 3, patch, patch))
            w.add_tensor("v.position_embd.weight", rand(n_patches, width))
        else:
            mels = 128
            w.add_uint32("clip.audio.num_mel_bins", mels)
            # Whisper's convolutions (kernel 3), their biases one per channel.
            w.add_tensor("a.conv1d.1.weight", rand(width, mels, 3))
            w.add_tensor("a.conv1d.1.bias", rand(width, 1))
            w.add_tensor("a.conv1d.2.weight", rand(width, width, 3))
            w.add_tensor("a.conv1d.2.bias", rand(width, 1))
            w.add_tensor("a.position_embd.weight", rand(1500, width))
        for i in range(blocks):
            for t in ("attn_q", "attn_k", "attn_v", "attn_out"):
                w.add_tensor(f"{prefix}.blk.{i}.{t}.weight", rand(width, width))
                if kind == "audio" and t != "attn_k":  # Whisper's k has no bias
                    w.add_tensor(f"{prefix}.blk.{i}.{t}.bias", rand(width))
            for t in ("ln1", "ln2"):
                w.add_tensor(f"{prefix}.blk.{i}.{t}.weight", np.ones(width, np.float32))
                w.add_tensor(f"{prefix}.blk.{i}.{t}.bias", np.zeros(width, np.float32))
            w.add_tensor(f"{prefix}.blk.{i}.ffn_up.weight", rand(hidden, width))
            w.add_tensor(f"{prefix}.blk.{i}.ffn_down.weight", rand(width, hidden))
        if kind == "vision":
            w.add_tensor("mm.0.weight", rand(hidden, width))
            w.add_tensor("mm.0.bias", rand(hidden))
            w.add_tensor("mm.2.weight", rand(n_text, hidden, sd=0.5))
            w.add_tensor("mm.2.bias", rand(n_text))
        else:
            w.add_tensor("mm.a.fc.weight", rand(n_text, width, sd=0.5))
            w.add_tensor("mm.a.fc.bias", rand(n_text))

    return fill


def build_all() -> list[Path]:
    """Write every fixture (for each test model installed)."""
    return [
        *(lora(kind, model) for model in ("smollm2", "gemma3") for kind in ("random", "zero")),
        *(control_vector(model) for model in ("smollm2", "gemma3")),
        *(mmproj(model, kind) for model in ("smollm2", "gemma3") for kind in ("vision", "audio")),
    ]


if __name__ == "__main__":
    for path in build_all():
        print(path)


# --- chat templates of the tool-call families -----------------------------------------
#
# Written here from each family's published description of its format (the
# markers and where they go), small enough to read: a system turn that lists
# the tools, the turns, earlier calls and tool results in the family's own
# syntax, and the generation prompt. ``chat_model`` embeds one into a copy of
# SmolLM2, so that the context reads it from the GGUF as it would a real one.

_CHATML_TURNS = """
{%- for m in messages if m.role != 'system' %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}{% for c in m.tool_calls or [] %}{{ call(c.function) }}{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}"""

_CHATML_SYSTEM = """
{%- set first = messages[0].content if messages and messages[0].role == 'system' else '' %}
{%- if tools %}<|im_start|>system
{% if first %}{{ first }}

{% endif %}# Tools

You may call the functions below.
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
{{ how }}<|im_end|>
{% elif first %}<|im_start|>system
{{ first }}<|im_end|>
{% endif %}"""

TOOL_TEMPLATES: dict[str, str] = {
    # Qwen 3: hermes calls, <think> reasoning, enable_thinking.
    "qwen3": (
        "{%- macro call(f) %}\n<tool_call>\n"
        "{{ {'name': f.name, 'arguments': f.arguments} | tojson }}\n</tool_call>{% endmacro %}"
        '{%- set how = \'Call one by writing <tool_call>{"name": ..., "arguments": {...}}'
        "</tool_call>.' %}" + _CHATML_SYSTEM + _CHATML_TURNS + "\n{%- if add_generation_prompt %}"
        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}{% endif %}"
    ),
    # Qwen3-Coder: a tag per parameter inside <tool_call><function=...>.
    "qwen3-coder": (
        "{%- macro call(f) %}\n<tool_call>\n<function={{ f.name }}>\n"
        "{% if f.arguments is mapping %}{% for k, v in f.arguments | items %}<parameter={{ k }}>\n"
        "{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}{% endif %}"
        "</function>\n</tool_call>{% endmacro %}"
        "{%- set how = 'Call one by writing <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\n"
        "VALUE\\n</parameter>\\n</function>\\n</tool_call>.' %}"
        + _CHATML_SYSTEM
        + _CHATML_TURNS
        + "\n{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # GLM-4.5: the function's name, then <arg_key>/<arg_value> pairs.
    "glm-4.5": (
        "[gMASK]<sop>{%- if tools %}<|system|>\n# Tools\n\n<tools>\n"
        "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n\n"
        "Call a function as <tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE"
        "</arg_value>\n</tool_call>{% endif %}"
        "{%- for m in messages %}{% if m.role == 'tool' %}<|observation|>\n"
        "<tool_response>\n{{ m.content }}\n</tool_response>"
        "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}\n<tool_call>{{ c.function.name }}\n"
        "{% if c.function.arguments is mapping %}{% for k, v in c.function.arguments | items %}"
        "<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v if v is string else v | tojson }}"
        "</arg_value>\n{% endfor %}{% endif %}</tool_call>{% endfor %}"
        "{% else %}<|{{ m.role }}|>\n{{ m.content }}{% endif %}{% endfor %}"
        "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
    ),
    # Kimi-K2: a declared tool list, calls in a section of indexed calls.
    "kimi-k2": (
        "{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>"
        "{% endif %}"
        "{%- for m in messages %}{% if m.role == 'assistant' %}"
        "<|im_assistant|>assistant<|im_middle|>{{ m.content or '' }}"
        "{% if m.tool_calls %}<|tool_calls_section_begin|>{% for c in m.tool_calls %}"
        "<|tool_call_begin|>functions.{{ c.function.name }}:{{ loop.index0 }}"
        "<|tool_call_argument_begin|>{{ c.function.arguments if c.function.arguments is string "
        "else c.function.arguments | tojson }}<|tool_call_end|>{% endfor %}"
        "<|tool_calls_section_end|>{% endif %}<|im_end|>"
        "{% elif m.role == 'tool' %}<|im_system|>tool<|im_middle|>{{ m.content }}<|im_end|>"
        "{% else %}<|im_{{ 'user' if m.role == 'user' else 'system' }}|>{{ m.role }}"
        "<|im_middle|>{{ m.content }}<|im_end|>{% endif %}{% endfor %}"
        "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
    ),
    # Granite: <|tool_call|> and a JSON list of calls.
    "granite": (
        "{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>"
        "{{ tools | tojson }}<|end_of_text|>\n{% endif %}"
        "{%- for m in messages %}<|start_of_role|>{{ 'tool_response' if m.role == 'tool' "
        "else m.role }}<|end_of_role|>{{ m.content or '' }}"
        "{% if m.tool_calls %}<|tool_call|>[{% for c in m.tool_calls %}"
        "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
        "{% if not loop.last %}, {% endif %}{% endfor %}]{% endif %}<|end_of_text|>\n"
        "{% endfor %}"
        "{%- if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}"
    ),
    # Command-R: actions as a JSON list between START/END_ACTION, thinking
    # and the response between their own tags.
    "command-r": (
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|># System Preamble\n"
        "{% if tools %}You can use these tools:\n```json\n{{ tools | tojson }}\n```\n"
        "Think in <|START_THINKING|><|END_THINKING|>, then act with "
        '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters": {...}}]'
        "<|END_ACTION|> or answer in <|START_RESPONSE|><|END_RESPONSE|>.{% endif %}"
        "<|END_OF_TURN_TOKEN|>"
        "{%- for m in messages if m.role != 'system' %}"
        "{% if m.role == 'assistant' %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
        "{% if m.tool_calls %}<|START_ACTION|>[{% for c in m.tool_calls %}"
        "{{ {'tool_call_id': loop.index0 | string, 'tool_name': c.function.name, "
        "'parameters': c.function.arguments} | tojson }}{% if not loop.last %}, {% endif %}"
        "{% endfor %}]<|END_ACTION|>{% else %}<|START_RESPONSE|>{{ m.content }}<|END_RESPONSE|>"
        "{% endif %}<|END_OF_TURN_TOKEN|>"
        "{% elif m.role == 'tool' %}<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><|START_TOOL_RESULT|>"
        "{{ m.content }}<|END_TOOL_RESULT|><|END_OF_TURN_TOKEN|>"
        "{% else %}<|START_OF_TURN_TOKEN|><|USER_TOKEN|>{{ m.content }}<|END_OF_TURN_TOKEN|>"
        "{% endif %}{% endfor %}"
        "{%- if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>{% endif %}"
    ),
    # GPT-OSS (harmony): channels, calls addressed to=functions.NAME,
    # reasoning_effort in the system message.
    "gpt-oss": (
        "<|start|>system<|message|>You are a helpful assistant.\n"
        "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
        "# Valid channels: analysis, commentary, final.<|end|>"
        "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\n"
        "namespace functions {\n{% for t in tools %}\n// {{ t.function.description or '' }}\n"
        "type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;\n"
        "{% endfor %}\n} // namespace functions<|end|>{% endif %}"
        "{%- for m in messages if m.role != 'system' %}"
        "{% if m.role == 'assistant' %}{% for c in m.tool_calls or [] %}"
        "<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} "
        "<|constrain|>json<|message|>{{ c.function.arguments if c.function.arguments is string "
        "else c.function.arguments | tojson }}<|call|>{% endfor %}"
        "{% if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
        "{% endif %}"
        "{% elif m.role == 'tool' %}<|start|>functions.{{ m.name or 'tool' }} to=assistant"
        "<|channel|>commentary<|message|>{{ m.content }}<|end|>"
        "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
        "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
    ),
}
"""Chat templates of the tool-call families, by format name (see
:data:`lloyal.CHAT_FORMATS`); ``qwen3`` speaks hermes."""


def chat_model(template: str, model: str = "smollm2") -> Path:
    """A copy of test model ``model`` whose GGUF holds
    ``TOOL_TEMPLATES[template]`` as its chat template."""
    source = TOOL_TEMPLATES[template]
    target = cache_dir() / f"{model}-template-{template}.gguf"
    return _variant(model, target, {"tokenizer.chat_template": source})


# Three of SmolLM2's special tokens no prompt of ours uses, renamed; and
# its own repository and file separators (llama.cpp finds neither by its
# text: it takes ``<reponame>`` for the repository).
_FIM_IDS = {"prefix": 7, "suffix": 8, "middle": 9}
_FIM_KEYS = {"pre": 7, "suf": 8, "mid": 9, "rep": 3, "sep": 5}


def fim_model() -> Path:
    """A copy of SmolLM2 with fill-in-the-middle tokens: special tokens 7,
    8 and 9 renamed ``<fim_prefix>``, ``<fim_suffix>`` and ``<fim_middle>``
    and named as such in the GGUF's ``tokenizer.ggml.fim_*_token_id``
    keys, with SmolLM2's ``<repo_name>`` and ``<file_sep>`` as the
    repository and file separators. The weights are SmolLM2's: the layout
    is right, the infill is not good."""
    target = cache_dir() / "smollm2-fim-v2.gguf"
    if target.is_file():
        return target
    tokens = list(
        _gguf().GGUFReader(model_path("smollm2")).fields["tokenizer.ggml.tokens"].contents()
    )
    for role, i in _FIM_IDS.items():
        tokens[i] = f"<fim_{role}>"
    keys = {
        "tokenizer.ggml.tokens": tokens,
        **{f"tokenizer.ggml.fim_{k}_token_id": i for k, i in _FIM_KEYS.items()},
    }
    return _variant("smollm2", target, keys)


_RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document answers the Query. "
    'Answer only "yes" or "no".<|im_end|>\n<|im_start|>user\n<Query>: {query}\n'
    "<Document>: {document}<|im_end|>\n<|im_start|>assistant\n"
)


def reranker() -> Path:
    """SmolLM2 as a Qwen 3 style reranker: the same weights under the
    ``qwen3`` architecture (its per-head Q/K norms set to ones), rank
    pooling, a classification head of two rows -- the output embeddings of
    "yes" and "no", so a score is the model's P(yes) against P(no) after
    the GGUF's ``tokenizer.chat_template.rerank`` prompt -- as llama.cpp
    converts Qwen3-Reranker. Small and real enough to run ``pooling="rank"``."""
    target = cache_dir() / "smollm2-reranker.gguf"
    if target.is_file():
        return target
    gguf = _gguf()
    reader = gguf.GGUFReader(model_path("smollm2"))
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    table = gguf.quants.dequantize(embd.data, embd.tensor_type)
    head = np.stack([table[tokens.index(w)] for w in ("yes", "no")]).astype(np.float32)
    fields = reader.fields
    n_layer = int(fields["llama.block_count"].contents())
    head_dim = int(fields["llama.embedding_length"].contents()) // int(
        fields["llama.attention.head_count"].contents()
    )
    norms = {
        f"blk.{i}.attn_{qk}_norm.weight": np.ones(head_dim, dtype=np.float32)
        for i in range(n_layer)
        for qk in ("q", "k")
    }
    keys = {
        "qwen3.pooling_type": 4,  # LLAMA_POOLING_TYPE_RANK
        "qwen3.classifier.output_labels": ["yes", "no"],
        "tokenizer.chat_template.rerank": _RERANK_TEMPLATE,
    }
    return _variant(
        "smollm2", target, keys, arch="qwen3", tensors={**norms, "cls.output.weight": head}
    )


def _variant(
    model: str,
    target: Path,
    keys: dict[str, Any],
    *,
    arch: str | None = None,
    tensors: dict[str, Any] | None = None,
) -> Path:
    """A copy of test model ``model`` at ``target`` (kept: written once)
    with its metadata ``keys`` set to these values (strings, ints, string
    lists); tensors and other keys as they were. ``arch``: another
    architecture (its keys renamed to it); ``tensors``: float32 arrays to
    add, by name."""
    if target.is_file():
        return target
    gguf = _gguf()
    reader = gguf.GGUFReader(model_path(model))
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.part")
    was = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(partial, arch or was)
    for field in reader.fields.values():
        name = field.name
        if name == "general.architecture" or name.startswith("GGUF.") or name in keys:
            continue
        if arch is not None and name.startswith(f"{was}."):
            name = f"{arch}.{name[len(was) + 1 :]}"
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    for name, value in keys.items():
        if isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, int):
            writer.add_uint32(name, value)
        else:
            writer.add_array(name, value)
    extra = tensors or {}
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    for name, array in extra.items():
        writer.add_tensor_info(
            name, array.shape, array.dtype, array.nbytes, gguf.GGMLQuantizationType.F32
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    for array in extra.values():
        writer.write_tensor_data(array)
    writer.close()
    partial.replace(target)
    return target
