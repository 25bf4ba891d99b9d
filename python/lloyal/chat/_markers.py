"""The markers of each chat family, written once: the reply parser looks
for them, the tool-call grammars and the template detection use them.

DeepSeek's markers use FULLWIDTH VERTICAL LINE (U+FF5C) and LOWER ONE
EIGHTH BLOCK (U+2581)."""

from __future__ import annotations

THINK = "<think>"
THINK_END = "</think>"
TOOL_CALL = "<tool_call>"  # hermes
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # llama3
LLAMA3_HEADER = "<|start_header_id|>"
TOOL_CALLS = "[TOOL_CALLS]"  # mistral
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
DS_CALLS = "<\uff5ctool\u2581calls\u2581begin\uff5c>"  # deepseek
DS_CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
DS_CALL = "<\uff5ctool\u2581call\u2581begin\uff5c>"
DS_CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
DS_SEP = "<\uff5ctool\u2581sep\uff5c>"
TOOL_CODE = "```tool_code"  # gemma
JSON_FENCE = "```json"
FENCE = "```"

QWEN_FUNCTION = "<function="  # qwen3-coder, inside <tool_call>
QWEN_PARAMETER = "<parameter="
ARG_KEY = "<arg_key>"  # glm45, inside <tool_call>
ARG_VALUE = "<arg_value>"
KIMI_SECTION = "<|tool_calls_section_begin|>"  # kimi-k2
KIMI_SECTION_END = "<|tool_calls_section_end|>"
KIMI_CALL = "<|tool_call_begin|>"
KIMI_ARGS = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
GRANITE_CALL = "<|tool_call|>"  # granite
CR_ACTION = ("<|START_ACTION|>", "<|END_ACTION|>")  # command-r
CR_THINKING = ("<|START_THINKING|>", "<|END_THINKING|>")
CR_RESPONSE = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")
HARMONY_CALL = "to=functions."  # gpt-oss: the recipient of a call
HARMONY_MESSAGE = "<|message|>"
HARMONY_ANALYSIS = ("<|channel|>analysis<|message|>", "<|end|>")
# Harmony's headers and ends, which are structure, not content.
HARMONY_STRUCTURE = (
    "<|start|>assistant",
    "<|channel|>final",
    "<|channel|>commentary",
    "<|constrain|>json",
    HARMONY_MESSAGE,
    "<|return|>",
    "<|call|>",
    "<|end|>",
)

# What opens and closes a call, for the grammars.
HERMES = (TOOL_CALL, TOOL_CALL_END)
DEEPSEEK = (DS_CALLS, DS_CALLS_END)
DEEPSEEK_CALL = (f"{DS_CALL}function{DS_SEP}", DS_CALL_END)
THINKING = (THINK, THINK_END)
