"""Server processes for the benchmark scenarios: started with :mod:`pdserve.topology.process` (the one
launcher), a failed start reported as a :class:`BenchError`.

Benchmarks ship with the package, so the scenarios start real ``pdserve`` processes themselves;
their CPU is read from outside, like any server's (:mod:`pdserve.bench.cpu`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.topology import process
from pdserve.topology.process import ServerProcess


class BenchError(RuntimeError):
    """The benchmark cannot produce trustworthy numbers (server failure or wrong output)."""


def start_all(servers: Sequence[ServerProcess], timeout_s: float = 120.0) -> None:
    """Spawn every server first, then wait (their imports and tokenizer loads overlap); a server that
    does not come up is a :class:`BenchError`."""
    try:
        process.start_all(servers, timeout_s)
    except process.ServerFailed as e:
        raise BenchError(str(e)) from None
