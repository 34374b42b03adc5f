"""``deepseek_r1``: reasoning up to the first ``</think>``, everything after is content.

After ``</think>`` the output passes through untouched (later think tags stay
literal content), which is the DeepSeek-R1 behaviour the reference describes.

Two details follow vLLM's batch ``extract_reasoning``, which drops the text
before ``<think>`` and always returns a reasoning string: whitespace before
an opening ``<think>`` at the start of the output is dropped (only
whitespace, so reasoning still streams at once), and a batch message that
started in reasoning reports ``""`` when there was no reasoning text.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.parsers.reasoning.base import THINK_END, THINK_START, ReasoningParser
from pdserve.parsers.scanner import TagSet


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    REASONING_TAGS = TagSet(THINK_START, THINK_END)
    CONTENT_TAGS = None
    DROPS_WHITESPACE_BEFORE_THINK = True
    EMPTY_REASONING_IS_STRING = True

    def is_reasoning_end(self, prompt_token_ids: Sequence[int]) -> bool:
        """Scan back over the whole prompt: the last think marker decides (none: not ended)."""
        for token_id in reversed(prompt_token_ids):
            if token_id == self._start_id:
                return False
            if token_id == self._end_id:
                return True
        return False
