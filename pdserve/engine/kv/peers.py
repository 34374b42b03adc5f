"""Remote engines' agent facts, fetched once from their ``GET /kv/metadata`` (on a worker
thread: the step loop never waits on the network).

vLLM's NixlConnector does this handshake over a side channel at ``remote_host:remote_port``;
pdserve serves the same facts on the prefill server's own HTTP port, so the params routers relay
(``remote_host``, ``remote_port``) name that server.
"""

from __future__ import annotations

import concurrent.futures
import urllib.request
from collections.abc import Callable

import msgspec

from pdserve.engine.kv.transport import TransferError
from pdserve.protocol.kv import KVAgentInfo, KVLayout, KVPull

FETCH_TIMEOUT_S = 5.0

Fetch = Callable[[str, int, str | None], KVAgentInfo]


def fetch_agent_info(host: str, port: int, api_key: str | None) -> KVAgentInfo:
    """GET a peer's ``/kv/metadata`` (with this server's API key: pools of one fleet share it)."""
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    request = urllib.request.Request(f"http://{netloc}/kv/metadata")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:
        return msgspec.json.decode(response.read(), type=KVAgentInfo)


class PeerDirectory:
    def __init__(self, layout: KVLayout, api_key: str | None, fetch: Fetch = fetch_agent_info) -> None:
        self._layout, self._api_key, self._fetch = layout, api_key, fetch
        self._known: dict[str, KVAgentInfo] = {}
        self._fetching: dict[tuple[str, int], concurrent.futures.Future[KVAgentInfo]] = {}
        self._threads = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pdserve-kv-peers")

    def lookup(self, pull: KVPull) -> KVAgentInfo | None:
        """The remote engine's facts; None while they are being fetched. Raises :class:`TransferError`
        when the fetch failed, the server there runs another engine, or its KV layout differs."""
        info = self._known.get(pull.remote_engine_id)
        if info is not None:
            return info
        where = (pull.host, pull.port)
        future = self._fetching.get(where)
        if future is None:
            self._fetching[where] = self._threads.submit(self._fetch, pull.host, pull.port, self._api_key)
            return None
        if not future.done():
            return None
        del self._fetching[where]
        url = f"http://{pull.host}:{pull.port}/kv/metadata"
        try:
            info = future.result()
        except Exception as e:  # noqa: BLE001 - any failure to reach the peer is a failed pull
            raise TransferError(f"fetching the prefill engine's KV metadata from {url} failed: {e}") from e
        if info.layout != self._layout:
            raise TransferError(f"the prefill engine at {url} has KV layout {info.layout}; this engine's is {self._layout}")
        self._known[info.engine_id] = info
        if info.engine_id != pull.remote_engine_id:
            raise TransferError(
                f"{url} runs engine {info.engine_id}, not {pull.remote_engine_id} (restarted since the prefill?)"
            )
        return info

    def forget(self, engine_id: str) -> None:
        """Fetch this engine's facts again next time (after a failed transfer: it may have restarted)."""
        self._known.pop(engine_id, None)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
