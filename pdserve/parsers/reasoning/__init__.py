"""Reasoning parsers: split ``<think>`` … ``</think>`` chain of thought from the answer."""

from pdserve.parsers.reasoning.base import ReasoningParser
from pdserve.parsers.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pdserve.parsers.reasoning.qwen3 import Qwen3ReasoningParser

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser"]
