"""Before any timing: does each server serve the output modes its arms ask for?

Servers differ: vLLM 0.32's generate serves ``tokens`` and ``text`` and refuses ``derender`` (400); a
generate server older than 0.32 takes ``output_mode`` as an unknown field and ignores it, so a
``text`` arm against it would measure ``tokens`` under another mode's label; a ``--tokens-only``
pdserve refuses every mode but ``tokens`` (400). One batch request of one token per server and mode
tells them apart: every generate answer echoes ``output_mode`` (a body without it is a ``tokens``
answer, docs/protocol.md), read as the proxy reads its decode members' answers (pdserve.proxy.preflight).
An arm whose mode a server does not serve is dropped from the run and reported, never measured under a
wrong label.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import httpx
import msgspec

from pdserve.bench.loadgen import GENERATE_PATH, JSON_HEADERS, Arm, Prompt, generate_body
from pdserve.proxy.preflight import mode_refusal as answer_refusal


@dataclass(frozen=True)
class SkippedArm:
    label: str
    reason: str


def mode_refusal(client: httpx.Client, base_url: str, prompt: Prompt, mode: str) -> str | None:
    """Why ``base_url`` does not serve ``mode`` (None when it does), from a one-token batch request."""
    probe = replace(prompt, max_tokens=1, ignore_eos=False)
    body = generate_body(Arm(label="preflight", base_url=base_url, stream=False), probe, mode)
    url = base_url + GENERATE_PATH
    try:
        response = client.post(url, content=msgspec.json.encode(body), headers=JSON_HEADERS)
    except httpx.HTTPError as e:
        return f"{url} failed: {e!r}"
    return answer_refusal(url, mode, response.status_code, response.content)


def servable_arms(arms: Sequence[Arm], prompt: Prompt, client: httpx.Client) -> tuple[list[Arm], list[SkippedArm]]:
    """The arms their servers serve, and the others with the reason; one probe per server and mode
    (``tokens`` is every generate server's default and is not probed)."""
    wanted = {(a.base_url, m) for a in arms if a.endpoint == "generate" for m in a.modes if m != "tokens"}
    refusals = {(url, mode): mode_refusal(client, url, prompt, mode) for url, mode in sorted(wanted)}
    kept, skipped = [], []
    for arm in arms:
        reasons = [r for m in arm.modes if (r := refusals.get((arm.base_url, m))) is not None]
        if arm.endpoint == "generate" and reasons:
            skipped.append(SkippedArm(arm.label, "; ".join(reasons)))
        else:
            kept.append(arm)
    return kept, skipped
