"""The proxy's two ways to produce OpenAI output (``--mode``) and to pick a pool member (``--routing``),
named once for the CLI, the flow and the pools.

* ``inline``: the decode leg returns OpenAI content itself (``derender`` for chat, ``text`` for
  completions);
* ``derender-tier``: the decode leg streams ``tokens`` and the render server's stateless
  ``/derender`` turns each chunk into OpenAI output (vLLM's path today; the benchmark baseline).
"""

from __future__ import annotations

from typing import Literal

Mode = Literal["inline", "derender-tier"]
MODES: tuple[Mode, ...] = ("inline", "derender-tier")

# --routing: the less busy of two members drawn at random (pdserve.proxy.pool says why), or each in turn.
Routing = Literal["p2c", "round-robin"]
ROUTINGS: tuple[Routing, ...] = ("p2c", "round-robin")
