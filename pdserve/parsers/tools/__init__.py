"""Tool-call parsers: turn tool-call markup in content into OpenAI tool calls."""

from pdserve.parsers.tools.base import ToolParser
from pdserve.parsers.tools.hermes import HermesToolParser
from pdserve.parsers.tools.qwen3_coder import Qwen3CoderToolParser

__all__ = ["HermesToolParser", "Qwen3CoderToolParser", "ToolParser"]
