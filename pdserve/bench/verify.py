"""Correctness of ``pdserve bench frontend``: a fast but wrong path must not win.

Kept apart from the orchestration so the rules a run must pass can be read, and
unit-tested on hand-made records, without starting a server.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pdserve.bench.loadgen import Arm, RequestRecord, assemble_message
from pdserve.bench.servers import BenchError
from pdserve.bench.workload import Script
from pdserve.text.tokenizer import Tokenizer


class Verifier:
    """Fails the run on the first request whose output differs from its script or from another arm.

    Text must equal the script decoded the way completions clients see it; a message must
    carry the script's reasoning, content (both compared without surrounding whitespace)
    and tool call. On top of that every output must equal, exactly (strings, tool-call
    argument text, finish_reason), the first output of the same script and kind from any
    arm. Every arm runs the same requests in each round, so each baseline is compared with
    the inline arm whenever both are selected.
    """

    def __init__(self, tokenizer: Tokenizer, scripts: Sequence[Script]):
        self._tokenizer = tokenizer
        self._scripts = scripts
        self._ids = [tokenizer.encode(s.output) for s in scripts]
        self._first: dict[tuple[int, str], tuple[Arm, Any, str | None]] = {}
        self.checked = 0
        self.compared = 0

    def check(self, record: RequestRecord) -> None:
        script, ids = self._scripts[record.script_index], self._ids[record.script_index]
        where = f"{record.arm.value}, script {record.script_index} ({script.kind}, {script.tokens} tokens)"
        if record.token_ids != ids:
            raise BenchError(f"{where}: token ids differ from the script ({len(record.token_ids)} vs {len(ids)})")
        if record.output_tokens != len(ids):
            raise BenchError(f"{where}: {record.output_tokens} token ids arrived, the script has {len(ids)}")
        kind = record.arm.output_kind
        output: Any = None
        if kind == "text":
            output = record.text
            expected = self._tokenizer.decode(ids[:-1], skip_special_tokens=True)
            if output != expected:
                raise BenchError(f"{where}: text differs from the script:\n{output[:300]!r}\n{expected[:300]!r}")
        elif kind == "message":
            output = assemble_message(record.deltas)
            self._check_message(where, output, script)
        self.checked += 1
        if kind != "ids":
            self._compare(record, kind, output, where)

    @staticmethod
    def _check_message(where: str, message: dict[str, Any], script: Script) -> None:
        if (message["reasoning"] or "").strip() != script.reasoning.strip():
            raise BenchError(f"{where}: reasoning differs from the script: {(message['reasoning'] or '')[:300]!r}")
        if message["content"].strip() != script.content.strip():
            raise BenchError(f"{where}: content differs from the script: {message['content'][:300]!r}")
        calls = [(name, json.loads(arguments)) for name, arguments in message["tool_calls"]]
        if calls != ([script.tool_call] if script.tool_call else []):
            raise BenchError(f"{where}: tool calls differ from the script: {message['tool_calls']!r}")

    def _compare(self, record: RequestRecord, kind: str, output: Any, where: str) -> None:
        first = self._first.setdefault((record.script_index, kind), (record.arm, output, record.finish_reason))
        if first[1:] != (output, record.finish_reason):
            raise BenchError(f"{where}: differs from {first[0].value} on the same script:\n"
                             f"{(output, record.finish_reason)!r}\n{first[1:]!r}")
        self.compared += 1
