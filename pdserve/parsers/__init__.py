"""Output parsers: reasoning (``deepseek_r1``, ``qwen3``) and tool calls (``hermes``, ``qwen3_coder``).

``ParserConfig`` holds the server flags; ``ChatParser`` (one per choice)
turns output text into an assistant message (batch) or deltas (streaming).
"""

from pdserve.parsers.parser import ChatParser, ParserConfig
from pdserve.parsers.registry import REASONING_PARSERS, TOOL_PARSERS, reasoning_parser_class, tool_parser_class

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChatParser",
    "ParserConfig",
    "reasoning_parser_class",
    "tool_parser_class",
]
