"""``pdserve up``'s plan: which flags each pool gets (the proxy's too), and the ports (nothing is started here)."""

from __future__ import annotations

import argparse

import pytest

from pdserve.topology.cli import add_up_args, proxy_flags, traces_flags
from pdserve.topology.plan import TopologyRequest, plan

PARSERS = ("--reasoning-parser", "qwen3")


def _args(spec_args: tuple[str, ...], flag: str) -> str:
    return spec_args[spec_args.index(flag) + 1]


def test_each_pool_gets_its_flags_and_the_proxy_every_url() -> None:
    req = TopologyRequest(model="qwen3-tiny", tokenizer_dir="/models/q", prefill=2, decode=1, mode="derender-tier",
                          parser_flags=PARSERS, serve_flags=("--max-model-len", "512", "--max-num-seqs=4"),
                          proxy_flags=("--api-key", "k"))
    specs = plan(req, lambda k: 9000 + k)
    assert [s.name for s in specs] == ["render", "prefill-0", "prefill-1", "decode-0", "proxy"]
    assert [s.port for s in specs] == [9001, 9002, 9003, 9004, 9000]
    render, prefill, _, decode, proxy = specs
    assert render.args[:4] == ("launch", "render", "--tokenizer", "/models/q")
    assert "--reasoning-parser" in render.args and _args(render.args, "--max-model-len") == "512"
    assert "--max-num-seqs=4" not in render.args
    assert prefill.args[:3] == ("serve", "qwen3-tiny", "--tokens-only")
    assert "--reasoning-parser" not in prefill.args  # a --tokens-only server takes no parser
    for server in (prefill, decode):
        assert _args(server.args, "--kv-transfer") == "nixl" and "--max-num-seqs=4" in server.args
        assert _args(server.args, "--host") == "127.0.0.1" and _args(server.args, "--port") == str(server.port)
    assert "--reasoning-parser" in decode.args and "--tokens-only" not in decode.args
    assert _args(proxy.args, "--prefill") == "http://127.0.0.1:9002,http://127.0.0.1:9003"
    assert _args(proxy.args, "--decode") == "http://127.0.0.1:9004"
    assert _args(proxy.args, "--render") == "http://127.0.0.1:9001"
    assert _args(proxy.args, "--mode") == "derender-tier" and _args(proxy.args, "--api-key") == "k"


def test_a_pool_needs_a_server() -> None:
    with pytest.raises(ValueError, match="at least one server"):
        plan(TopologyRequest(model="m", tokenizer_dir="d", decode=0), lambda k: k)


def test_each_engine_server_takes_its_pools_legs_only() -> None:
    specs = plan(TopologyRequest(model="m", tokenizer_dir="d", prefill=2, decode=2), lambda k: 9000 + k)
    roles = {s.name: _args(s.args, "--kv-role") for s in specs if s.role in ("prefill", "decode")}
    assert roles == {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}
    assert not any("--engine" in s.args or "--kv-side-channel-port" in s.args for s in specs)


def test_vllm_engines_get_a_nixl_side_channel_each_past_the_http_ports() -> None:
    specs = plan(TopologyRequest(model="qwen3-tiny", tokenizer_dir="d", prefill=1, decode=2, engine="vllm",
                                 parser_flags=PARSERS), lambda k: 9000 + k)
    engines = [s for s in specs if s.role in ("prefill", "decode")]
    for server in engines:
        assert _args(server.args, "--engine") == "vllm" and _args(server.args, "--kv-transfer") == "nixl"
        assert _args(server.args, "--kv-host") == "127.0.0.1"
    side = [int(_args(s.args, "--kv-side-channel-port")) for s in engines]
    http = {s.port for s in specs}
    assert side == [9005, 9006, 9007] and http == {9000, 9001, 9002, 9003, 9004}
    assert "--engine" not in specs[0].args and "--tokens-only" in engines[0].args  # render; a lean prefill


def test_the_proxy_gets_ups_log_settings_and_per_request_metrics_when_the_servers_do() -> None:
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    plain = parser.parse_known_args(["qwen3-tiny"])[0]
    assert proxy_flags(plain, []) == ("--log-level", "warning")
    args, serve_flags = parser.parse_known_args(["qwen3-tiny", "--log-format", "json", "--api-key", "k",
                                                 "--enable-per-request-metrics", "--max-model-len", "512"])
    assert proxy_flags(args, serve_flags) == ("--log-level", "warning", "--log-format", "json",
                                              "--enable-per-request-metrics", "--api-key", "k")


def test_every_process_up_starts_gets_the_traces_endpoint() -> None:
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    args, serve_flags = parser.parse_known_args(["qwen3-tiny", "--otlp-traces-endpoint", "http://127.0.0.1:4318"])
    assert serve_flags == [] and traces_flags(args) == ("--otlp-traces-endpoint", "http://127.0.0.1:4318")
    # as run_up composes them: the servers' extra flags (the render server takes it from there), the proxy's
    req = TopologyRequest(model="qwen3-tiny", tokenizer_dir="d", decode=2, serve_flags=traces_flags(args),
                          proxy_flags=proxy_flags(args, serve_flags))
    specs = plan(req, lambda k: 9000 + k)
    assert [s.name for s in specs] == ["render", "prefill-0", "decode-0", "decode-1", "proxy"]
    assert all(_args(s.args, "--otlp-traces-endpoint") == "http://127.0.0.1:4318" for s in specs)
    plain = parser.parse_known_args(["qwen3-tiny"])[0]
    assert traces_flags(plain) == () and not any("--otlp-traces-endpoint" in s.args for s in plan(
        TopologyRequest(model="m", tokenizer_dir="d", proxy_flags=proxy_flags(plain, [])), lambda k: k))
