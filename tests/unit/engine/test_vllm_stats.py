"""vLLM's stat records folded into pdserve's counters (the logger vLLM calls once per engine step; vLLM
itself runs in tests/interop): prompt positions computed and pulled, KV transfers, prefix-cache queries and
hits, each record adding its interval's figures."""

from __future__ import annotations

from types import SimpleNamespace

from pdserve.engine.runners.vllm_runner import KV_CONNECTOR, VllmStatsLogger
from pdserve.protocol.kv import KVStats


def test_records_add_up_every_interval() -> None:
    logged = VllmStatsLogger(KVStats())
    for queries, hits in ((120, 0), (130, 112)):
        iteration = SimpleNamespace(prompt_token_stats=SimpleNamespace(computed=queries - hits, external_kv_transfer=0))
        scheduler = SimpleNamespace(prefix_cache_stats=SimpleNamespace(queries=queries, hits=hits),
                                    kv_connector_stats={KV_CONNECTOR: {"transfer_duration": [0.01],
                                                                       "bytes_transferred": [4096]}})
        logged.record(scheduler, iteration)
    assert (logged.prefix_cache_queries, logged.prefix_cache_hits, logged.prompt_tokens_computed) == (250, 112, 138)
    assert (logged.kv.pulls_ok, logged.kv.pulled_bytes) == (2, 8192)
    logged.record(SimpleNamespace(), None)  # a record without those stats changes nothing
    assert (logged.prefix_cache_queries, logged.prefix_cache_hits) == (250, 112)
