"""How long idle HTTP/1.1 keep-alive connections live, on pdserve's servers and in its own clients.

A server that closes an idle connection races every client that may reuse it: a request written onto
the connection while the server closes it reaches a closed socket, the kernel answers with a reset, and
the client sees a read error for a request no server ever saw (``httpx.ReadError('')``). The race is
lost only when the client still holds the connection for valid at the moment the server gives up on it,
so the rule is that the server's idle timeout outlasts its clients' idle expiry, with room for the time
a client takes to read an answer's last bytes. uvicorn's default (and so vLLM's) is 5 s, exactly the
expiry of httpx and the openai SDK; under load that lost about one request in 5,000 (issue 26,
docs/reliability.md).
"""

from __future__ import annotations

# pdserve's servers (serve, launch render, proxy) keep an idle connection this long (--timeout-keep-alive):
# past httpx's and the openai SDK's 5 s and aiohttp's 15 s, by a margin no client's read lag reaches.
SERVER_KEEP_ALIVE_S = 75.0
# pdserve's own clients (the proxy's members) drop an idle connection after this long: below uvicorn's
# and vLLM's 5 s, so a stock vLLM member never closes a connection the proxy is about to reuse.
CLIENT_KEEP_ALIVE_EXPIRY_S = 4.0
