"""A vLLM general plugin (entry point ``vllm.general_plugins``) that paces vLLM's NIXL progress thread.

Why: vLLM's NixlConnector builds its NIXL agent through the Python wrapper, which starts the agent's
progress thread with no pause between turns, so every vLLM engine with a NIXL agent spins a whole core
for as long as it runs, busy or idle. On a host with few cores two such engines (a prefill and a decode
server) take every core: measured on a 2-vCPU host, the prefill side then answered the decode side's
NIXL handshake only after its 5 s timeout, and a decode leg's pull finished only once the prefill's
lease had run out and its engine went idle (each decode leg took the lease, 10 or 30 s; the prefill
logged "Potentially invalid KV blocks ... were retrieved by a decode worker. They may have expired").
pdserve paces its own agents (:data:`pdserve.engine.kv.transport.PROGRESS_THREAD_DELAY_US`); this does
the same inside vLLM's processes.

vLLM loads general plugins in each of its processes (the engine core and every worker), before the
connector builds its agent. The plugin acts only where :data:`PACE_ENV` is ``1``: ``pdserve serve
--engine vllm --kv-transfer nixl`` sets it for its own engine, so a stock ``vllm serve`` in the same
venv is left as vLLM made it unless its operator sets the variable too.
"""

from __future__ import annotations

import os

PACE_ENV = "PDSERVE_PACE_NIXL"


def pace_nixl_progress() -> None:
    """Make every NIXL agent this process builds from now on pause between progress turns."""
    if os.environ.get(PACE_ENV) != "1":
        return
    try:
        from nixl_cu12 import _api
    except ImportError:
        return  # no NIXL here: vLLM's connector says so itself
    from pdserve.engine.kv.transport import paced_config_type

    if not getattr(_api.nixlBind.nixlAgentConfig, "paced_by_pdserve", False):
        _api.nixlBind.nixlAgentConfig = paced_config_type(_api)
