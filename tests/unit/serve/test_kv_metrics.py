"""KV hand-off and prefix-cache series in /metrics: present from the start (before the engine core's first
heartbeat), then the engine's counters, with the pull-latency histogram cumulative as Prometheus wants it."""

from __future__ import annotations

from prometheus_client import generate_latest

from pdserve.protocol.engine import EngineInfo, EngineStats
from pdserve.protocol.kv import KVAgentInfo, KVLayout, KVStats
from pdserve.serve.metrics import Metrics

POOL = KVAgentInfo(engine_id="e", backend="nixl", agent_metadata=b"", base_address=0, num_slots=4, slot_positions=64,
                   layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float32", itemsize=4))


def scrape(stats: EngineStats, pool: KVAgentInfo | None, prefix_cache_blocks: int | None = None) -> str:
    info = EngineInfo(model_name="m", vocab_size=10, max_model_len=64, max_num_seqs=1, eos_token_ids=[], kv=pool,
                      prefix_cache_blocks=prefix_cache_blocks)
    return generate_latest(Metrics(lambda: stats, lambda: info).registry).decode()


def test_series_exist_before_the_first_heartbeat_and_only_with_kv_transfer() -> None:
    text = scrape(EngineStats(), POOL)
    assert "pdserve_kv_slots 4.0" in text and "pdserve_kv_free_slots 4.0" in text
    assert "pdserve_kv_pulled_bytes_total 0.0" in text
    assert "pdserve_kv_" not in scrape(EngineStats(), None)


def test_engine_counters_and_a_cumulative_histogram() -> None:
    kv = KVStats(slots=4, free_slots=3, held_blocks=4, pulls_ok=3, pulled_bytes=4096)
    for seconds in (0.0005, 0.004, 20.0):
        kv.observe_pull(seconds)
    text = scrape(EngineStats(kv=kv, prompt_tokens_computed=7), POOL)
    assert "pdserve_kv_held_blocks 4.0" in text and "pdserve_kv_pulled_bytes_total 4096.0" in text
    assert "pdserve_engine_prompt_tokens_computed_total 7.0" in text
    assert 'pdserve_kv_pull_seconds_bucket{le="0.001"} 1.0' in text
    assert 'pdserve_kv_pull_seconds_bucket{le="0.005"} 2.0' in text
    assert 'pdserve_kv_pull_seconds_bucket{le="+Inf"} 3.0' in text and "pdserve_kv_pull_seconds_count 3.0" in text


def test_prefix_cache_series_exist_from_the_start_and_only_with_the_cache() -> None:
    text = scrape(EngineStats(), None, prefix_cache_blocks=32)
    assert "pdserve_prefix_cache_queries_total 0.0" in text and "pdserve_prefix_cache_hits_total 0.0" in text
    assert "pdserve_prefix_cache" not in scrape(EngineStats(), None)
    counted = scrape(EngineStats(prefix_cache_queries=300, prefix_cache_hits=128), None, prefix_cache_blocks=32)
    assert "pdserve_prefix_cache_queries_total 300.0" in counted and "pdserve_prefix_cache_hits_total 128.0" in counted
