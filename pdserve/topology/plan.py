"""Which processes ``pdserve up`` starts, with which flags and ports (no process is started here).

The flags each pool gets:

* render: ``launch render --tokenizer <the model's dir>`` + the parser flags (it renders chat
  templates and, in ``derender-tier``, parses output);
* prefill: ``serve MODEL --tokens-only`` + the extra serve flags: it only fills KV, so it loads no
  tokenizer and takes no parser flags;
* decode: ``serve MODEL`` + the parser flags + the extra serve flags (it returns parsed output);
* proxy: ``proxy --render URL --prefill URLS --decode URLS --mode MODE``.

Every prefill and decode server also gets :data:`KV_TRANSFER_FLAGS`, the KV hand-off switch, and its
pool as ``--kv-role`` (a leg sent to the wrong pool is a 400 naming the role). With ``engine="vllm"``
they run ``--engine vllm``: vLLM's NixlConnector, whose NIXL side channel listens on a port of its own
per server (``--kv-side-channel-port``, taken after the HTTP ports; vLLM's default 5600 would collide
between two servers on one host).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.topology.members import MemberSpec

# The serve flags that switch on the KV hand-off between the prefill and decode pools.
KV_TRANSFER_FLAGS: tuple[str, ...] = ("--kv-transfer", "nixl")
# Extra serve flags that the render server needs as well (it bounds derender input by the model length, and
# logs and traces as they do).
RENDER_SHARED_FLAGS = ("--max-model-len", "--log-format", "--otlp-traces-endpoint")


@dataclass(frozen=True)
class TopologyRequest:
    model: str
    tokenizer_dir: str
    prefill: int = 1
    decode: int = 1
    mode: str = "inline"
    parser_flags: tuple[str, ...] = ()
    serve_flags: tuple[str, ...] = ()  # extra `pdserve serve` flags for the prefill and decode servers
    proxy_flags: tuple[str, ...] = ()  # e.g. --api-key KEY
    engine: str = "torch"  # torch | vllm (the prefill and decode servers' engine)


def _shared_with_render(serve_flags: Sequence[str]) -> list[str]:
    """``--max-model-len N`` (or ``--max-model-len=N``) from the extra serve flags, for the render server."""
    out: list[str] = []
    for i, flag in enumerate(serve_flags):
        name = flag.split("=", 1)[0]
        if name in RENDER_SHARED_FLAGS:
            out += [flag] if "=" in flag else list(serve_flags[i:i + 2])
    return out


def plan(req: TopologyRequest, port_for: Callable[[int], int]) -> list[MemberSpec]:
    """Render, prefill-0.., decode-0.., then the proxy (last: it is started once the others are healthy).

    ``port_for(k)`` is the k-th port: the proxy gets k=0 and the servers 1, 2, ... in start order.
    """
    if req.prefill < 1 or req.decode < 1:
        raise ValueError("--prefill and --decode need at least one server each")
    loopback = ("--host", "127.0.0.1")
    specs = [MemberSpec("render", "render", (
        "launch", "render", "--tokenizer", req.tokenizer_dir, *req.parser_flags, *_shared_with_render(req.serve_flags),
        *loopback, "--port", str(port_for(1)),
    ), port_for(1))]
    engine_servers = req.prefill + req.decode
    first_side_channel = len(specs) + engine_servers + 1  # the port index after every HTTP port
    side_channels = iter([port_for(first_side_channel + i) for i in range(engine_servers)]
                         if req.engine == "vllm" else [])

    def kv_flags(role: str) -> tuple[str, ...]:
        flags = (*KV_TRANSFER_FLAGS, "--kv-role", role)
        if req.engine == "vllm":
            flags += ("--engine", "vllm", "--kv-host", "127.0.0.1", "--kv-side-channel-port", str(next(side_channels)))
        return flags

    for i in range(req.prefill):
        port = port_for(len(specs) + 1)
        specs.append(MemberSpec(f"prefill-{i}", "prefill", (
            "serve", req.model, "--tokens-only", *kv_flags("prefill"), *req.serve_flags, *loopback, "--port", str(port),
        ), port))
    for i in range(req.decode):
        port = port_for(len(specs) + 1)
        specs.append(MemberSpec(f"decode-{i}", "decode", (
            "serve", req.model, *kv_flags("decode"), *req.parser_flags, *req.serve_flags, *loopback,
            "--port", str(port),
        ), port))

    def urls(role: str) -> str:
        return ",".join(s.url for s in specs if s.role == role)

    specs.append(MemberSpec("proxy", "proxy", (
        "proxy", "--render", urls("render"), "--prefill", urls("prefill"), "--decode", urls("decode"),
        "--mode", req.mode, *req.proxy_flags, *loopback, "--port", str(port_for(0)),
    ), port_for(0)))
    return specs
