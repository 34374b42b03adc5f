"""CLI parser names -> parser classes (``--reasoning-parser``, ``--tool-call-parser``).

Names and aliases follow vLLM 0.33. There is deliberately no tool parser
called ``qwen3`` (vLLM has only the reasoning one); asking for it is an error
that lists the valid names.
"""

from __future__ import annotations

from pdserve.parsers.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser
from pdserve.parsers.tools import HermesToolParser, Qwen3CoderToolParser, ToolParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "step5": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_json": HermesToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        valid = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; valid --reasoning-parser values: {valid}") from None


def tool_parser_class(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        valid = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; valid --tool-call-parser values: {valid}") from None
