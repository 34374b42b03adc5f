"""``pdserve up qwen3-tiny --engine vllm`` (from .venv-vllm): a render server, a vLLM-engine prefill and decode
server exchanging KV over vLLM's NixlConnector, and the proxy. The openai SDK's streamed chat (qwen3 +
hermes parsers, a tool offered) through the proxy equals the decode member's own coupled answer, and the
decode member's ``/metrics`` shows the prompt's KV pulled, not computed, and then read from vLLM's prefix
cache by the coupled request."""

from __future__ import annotations

import pytest

from tests.interop.chats import WEATHER, client, folded_stream, markup_bias
from tests.serverproc import metric_sum
from tests.upproc import Up
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(1800)
PARSERS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice")


def test_up_engine_vllm_answers_the_openai_sdk_and_the_decode_member_pulls_the_kv() -> None:
    topology = Up("qwen3-tiny", "--engine", "vllm", "--port", "0", *PARSERS, "--dtype=float32")
    try:
        base = topology.wait_ready(bound_s=1500)
        assert "warming 1 prefill -> decode hand-off(s)" in topology.output
        decode = topology.members["decode-0"][0]
        counters = ("pdserve_kv_pulls_ok_total", "pdserve_kv_pulled_tokens_total",
                    "pdserve_engine_prompt_tokens_computed_total")
        before = [metric_sum(decode, name) for name in counters]
        kwargs = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                  "tools": [WEATHER], "max_tokens": 24, "temperature": 1.0, "seed": 0, "logit_bias": markup_bias(),
                  "extra_body": {"return_token_ids": True}}
        proxied = folded_stream(client(base.removesuffix("/v1")), kwargs)
        _, reasoning, _, ids, tokens = proxied
        assert reasoning and len(ids) == tokens == 24
        pulls, pulled, computed = (metric_sum(decode, name) - b for name, b in zip(counters, before))
        assert pulls == 1 and pulled > 16 and computed == 0  # the prompt came over NIXL; none computed here
        hits = metric_sum(decode, "pdserve_prefix_cache_hits_total")
        assert proxied == folded_stream(client(decode), kwargs)  # the decode engine's own coupled answer
        # The same prompt again: vLLM's prefix cache kept the pulled blocks, and its hits reach /metrics.
        wait_until(lambda: metric_sum(decode, "pdserve_prefix_cache_hits_total") >= hits + 16, "vLLM's prefix hits")
    finally:
        topology.stop()
